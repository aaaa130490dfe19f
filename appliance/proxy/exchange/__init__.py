"""The exchange: one client request's calls to P and D (docs/protocol.md steps 8-10, 24-25, 38-43).

- `bodies`: the request P gets and the one D gets (pure functions on the decoded body);
- `paths`: the paths a request takes (P and D at once, P's token first, D alone, D or P
  alone when placed local) and the KV's holder as each leg goes;
- `first_token`: P's token straight to a streaming client, D continuing after it;
- `relay`: D's answer to the client, whole or streamed.
"""

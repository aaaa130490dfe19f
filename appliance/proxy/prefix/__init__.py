"""Prefix-cache state that is right: each P's and D's own KV events, in one index, and a
request's lookup against it (how many of its prompt tokens each node would not compute).

- `cache`: the index as the proxy asks it, a request's `Lookup`;
- `hashing`: vLLM's sha256_cbor block hashes from token ids (pure);
- `wire`: the events as vLLM sends them (msgpack);
- `index`: what each engine holds, by its events (pure, no sockets);
- `events`: the ZMQ subscriptions that feed it, with replay and resync;
- `tokens`: a prompt's token ids through a node's /tokenize;
- `tokenizer`: the same ids in process, from the model's tokenizer folder, checked against
  /tokenize.
"""

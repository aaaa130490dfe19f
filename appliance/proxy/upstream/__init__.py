"""The upstream client: pooled keep-alive connections per node (`pool`) and each call's
response, parsed by llhttp (`response`)."""

"""The node on this host: `pdctl validate/render/up/down/compose/logs/status` (`cmd`), the
files rendered from the host config (`render`, `observability`), the node under Docker
Compose (`compose`, `dockerapi`) or as `--local` processes (`local`, and the state file that
finds them again: `localstate`), what its services report (`status`), why one failed
(`logcause`), and the proxy's admin commands `drain` and `tracing` (`admincmd`)."""

"""The per-host config: one TOML file per host (`hostconfig`: HostConfig, reading and
validating it), its sections (`sections`, `hostsections`; `proxysection`, the proxy's own
settings passed through) and writing it back (`toml`)."""

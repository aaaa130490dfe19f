"""The per-host config: one TOML file per host (`hostconfig`: HostConfig, reading and
validating it), its sections (`sections`, `hostsections`) and writing it back (`toml`)."""

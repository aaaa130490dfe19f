"""This host: what it has (`probe`: GPUs, RDMA, memlock, ports, Docker, read through a
root that tests fake; `topology`: PCIe and NUMA; `composebin`: which Compose runs), what its
config asks of it (`check`), the preflight (`doctor`, `pcichecks`, `verdict`; the command:
`doctorcmd`), and `pdctl init`, which writes a config from what it finds (`init`)."""

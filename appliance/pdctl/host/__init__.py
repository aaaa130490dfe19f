"""This host: what it has (`probe`: GPUs, RDMA, memlock, ports, Docker, read through a
root that tests fake), what its config asks of it (`check`), the preflight (`doctor`), and
`pdctl init`, which writes a config from what it finds (`init`)."""

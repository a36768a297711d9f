"""The host tier's K/V: a pool of blocks in host memory, and the copies between it and the device cache.

``kv_offload.HostTier`` decides which host block holds which prefix block; this module
holds the tensors and makes a step's copies (``KVCopies``) before its forward: device ->
host first (blocks being evicted or idle), then host -> device (host hits being admitted).
Per layer, K and V: one gather from the source blocks and one scatter into the targets,
so a step's copies cost 2 x 2 x layers tensor copies however many blocks move.

On CUDA the host pool is pinned memory. Host -> device copies are asynchronous on the
compute stream (the step's forward is queued behind them, in stream order, and the host
thread does not wait); device -> host copies wait for the stream, because the host
scatters the gathered blocks into its pool at once. On the CPU the "host pool" is a second buffer in the same memory: the copies are
plain memory copies on the step's critical path, and ``seconds`` measures what they cost.
"""
from __future__ import annotations

import time

import torch

from .kv_offload import KVCopies


class HostKVCache:
    """Per layer (K, V), each ``[num_blocks, block_size, num_kv_heads, head_dim]`` in host memory."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int):
        k0 = kv_caches[0][0]
        pin = k0.device.type == "cuda"
        shape = (num_blocks, *k0.shape[1:])
        self.caches = [(torch.zeros(shape, dtype=k.dtype, pin_memory=pin), torch.zeros(shape, dtype=v.dtype, pin_memory=pin))
                       for k, v in kv_caches]
        self.block_bytes = sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
                               for k, v in self.caches)  # one block, every layer, K and V
        self.blocks_out = self.blocks_in = 0
        self.seconds = 0.0  # host time spent making copies (on CUDA: queueing them)

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.caches[0][0].shape[0]

    @property
    def bytes_out(self) -> int:
        return self.blocks_out * self.block_bytes

    @property
    def bytes_in(self) -> int:
        return self.blocks_in * self.block_bytes

    @torch.inference_mode()
    def apply(self, copies: KVCopies, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make ``copies``: every device -> host copy, then every host -> device copy."""
        if not copies:
            return
        start = time.perf_counter()
        device = kv_caches[0][0].device
        if copies.outs:
            src = torch.tensor([d for d, _ in copies.outs], device=device)
            dst = torch.tensor([h for _, h in copies.outs])
            for (dk, dv), (hk, hv) in zip(kv_caches, self.caches):
                hk.index_copy_(0, dst, dk.index_select(0, src).to("cpu"))  # waits for the stream on CUDA
                hv.index_copy_(0, dst, dv.index_select(0, src).to("cpu"))
            self.blocks_out += len(copies.outs)
        if copies.ins:
            src = torch.tensor([h for h, _ in copies.ins])
            dst = torch.tensor([d for _, d in copies.ins], device=device)
            for (dk, dv), (hk, hv) in zip(kv_caches, self.caches):
                dk.index_copy_(0, dst, _to_device(hk.index_select(0, src), device))
                dv.index_copy_(0, dst, _to_device(hv.index_select(0, src), device))
            self.blocks_in += len(copies.ins)
        self.seconds += time.perf_counter() - start


def _to_device(blocks: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host blocks onto ``device``: on CUDA from pinned memory, without waiting."""
    if device.type == "cpu":
        return blocks
    return blocks.pin_memory().to(device, non_blocking=True)


__all__ = ["HostKVCache"]

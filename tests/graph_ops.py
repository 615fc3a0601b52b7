"""Which calls a traced graph of three Triton-faced metadata ops holds: the dsa ops or the
Triton kernels themselves.

``metadata_graph_calls(device)`` traces ``decode_token_lens``, ``expand_block_table`` and
``decode_row_requests`` the way ``torch.compile`` hands a graph to Inductor (AOTAutograd's
functionalized graph) and counts its ``dsa`` ops and Triton kernel calls. With
``device="cuda"`` the inputs are fake CUDA tensors, so it runs on a CPU-only machine, but only
with real Triton kernels (not under ``TRITON_INTERPRET``): ``python -m tests.graph_ops cuda``
prints the counts as JSON, for a subprocess. (On a CPU-only build, fake CUDA tensors cannot
go through view ops under functionalization, which most faces and the Indexer need: the
whole step is checked on the GPU, by its AOTInductor package.)
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter

import torch
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import FakeTensorMode

import dsa


class _Metadata(torch.nn.Module):
    def forward(self, batch: dsa.Batch) -> tuple[torch.Tensor, ...]:
        qsl, tokens = batch.query_start_loc, batch.positions.numel()
        return (torch.ops.dsa.decode_token_lens(qsl, batch.seq_lens, tokens),
                torch.ops.dsa.expand_block_table(qsl, batch.block_table, tokens),
                torch.ops.dsa.decode_row_requests(qsl, tokens))


def metadata_graph_calls(device: str) -> dict[str, int]:
    """``{"dsa": n, "triton": m}``: dsa ops and Triton kernel calls in the traced graph."""
    # Without a GPU, Triton cannot analyse which arguments a kernel writes (it assumes all).
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device(device):
        batch = dsa.Batch(
            query_start_loc=torch.tensor([0, 2, 3, 3], dtype=torch.int32),
            seq_lens=torch.tensor([130, 7, 0], dtype=torch.int32),
            block_table=torch.arange(48, dtype=torch.int32).view(3, 16),
            slot_mapping=torch.tensor([128, 129, 1030, -1, -1, -1]),
            positions=torch.tensor([128, 129, 6, 0, 0, 0]),
        )
        graph, _ = aot_export_module(_Metadata(), (batch,), trace_joint=False)
    targets = Counter(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
    return {"dsa": sum(c for t, c in targets.items() if t.startswith("dsa.")),
            "triton": targets["triton_kernel_wrapper_functional"]}


if __name__ == "__main__":
    print(json.dumps(metadata_graph_calls(sys.argv[1])))

"""``torch.compile`` backends registered by name that keep every Dynamo graph they are given, for tests
that inspect the graphs ``compile_backbone`` (which takes a backend name) builds: one runs the graph as
traced, the other hands it on to ``aot_eager`` (AOT autograd's trace, what Inductor receives)."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.backends.registry import register_backend

__all__ = ["GRAPHS", "RECORD", "RECORD_AOT"]

#: The graphs the backend was given, in order; tests clear it before compiling.
GRAPHS: list[torch.fx.GraphModule] = []
#: The backends' names.
RECORD = "vtdense_test_record_graphs"
RECORD_AOT = "vtdense_test_record_graphs_aot_eager"

if RECORD not in torch._dynamo.list_backends(exclude_tags=()):

    @register_backend(name=RECORD)
    def _record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        GRAPHS.append(gm)
        return gm.forward

if RECORD_AOT not in torch._dynamo.list_backends(exclude_tags=()):

    @register_backend(name=RECORD_AOT)
    def _record_aot(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._dynamo.backends.debugging import aot_eager

        GRAPHS.append(gm)
        return aot_eager(gm, example_inputs)

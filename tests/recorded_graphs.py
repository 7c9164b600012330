"""A ``torch.compile`` backend registered by name that keeps every Dynamo graph it is given and runs
it as traced, for tests that inspect the graphs ``compile_backbone`` (which takes a backend name) builds."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.backends.registry import register_backend

__all__ = ["GRAPHS", "RECORD"]

#: The graphs the backend was given, in order; tests clear it before compiling.
GRAPHS: list[torch.fx.GraphModule] = []
#: The backend's name.
RECORD = "vtdense_test_record_graphs"

if RECORD not in torch._dynamo.list_backends(exclude_tags=()):

    @register_backend(name=RECORD)
    def _record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        GRAPHS.append(gm)
        return gm.forward

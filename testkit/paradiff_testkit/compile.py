"""A torch.compile backend for tests: records the operators of every graph it is given, then compiles it."""

from __future__ import annotations

from typing import Any

import torch


class RecordingBackend:
    """Keeps, per compiled graph, the targets of its call_function nodes (e.g. "paradiff.cp_attention.default",
    "_c10d_functional.all_reduce.default"), then hands the graph to `then` ("aot_eager", "inductor", ...)."""

    def __init__(self, then: str = "aot_eager") -> None:
        self.then = then
        self.graphs: list[list[str]] = []

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]):
        self.graphs.append([str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"])
        return torch._dynamo.lookup_backend(self.then)(graph_module, example_inputs)

    def count(self, fragment: str) -> int:
        """How many nodes over all graphs have `fragment` in their target."""
        return sum(fragment in target for graph in self.graphs for target in graph)

"""Registers the interpreter as the ``interpret`` target."""

from __future__ import annotations

from ...dsl.ir import Module
from ...dsl.printer import format_module
from ...passes.fuse_elementwise import fuse_elementwise
from ..target import Artifact, Target, register_target
from .machine import run_module


class InterpretTarget(Target):
    name = "interpret"
    stages = ("ir",)

    def lower(self, module: Module, knobs) -> Module:
        return fuse_elementwise(module)

    def generate(self, module: Module, knobs) -> Artifact:
        return Artifact(module.name, self.name, stages={"ir": format_module(module)})

    def load(self, artifact: Artifact, module: Module):
        return lambda tensors: run_module(module, tensors)


register_target(InterpretTarget())

"""The Inductor code generator: ttftc's passes as Inductor's post-grad custom pass.

`Config(codegen="inductor")` hands Dynamo's graph to Inductor with freezing on (the backend first gives the model's
weights back to the graph module, capture.weights_as_attributes, so that Inductor can freeze them). Inductor
captures the aten graph, folds the frozen weights into constants, runs its own post-grad passes and then
`TtftcPostGradPass`: ttftc's passes and lowering (ttftc/pipeline.py), the same objects the eager code generator
runs; which is why this module sits beside the backend, above the pipeline, rather than in codegen/. What Inductor gets back is an ordinary graph of aten ops and custom ops: attention and the GEMMs are their
chosen lowering's op (codegen/lowered_ops.py), which Inductor calls as an extern kernel; the glue-heavy ops are
inlined as their decompositions (codegen/inductor/), and everything between the kernels (RoPE, residual adds, norms,
casts, per-token quantisation, scale multiplies) is Inductor's to fuse into generated C++ or Triton.

The pass is also what vLLM loads by name:

    compilation_config = {"inductor_passes": {"post_grad_custom_post_pass": "ttftc.inductor_pass.post_grad_pass"}}

`post_grad_pass` runs the default Config. Its `uuid()` joins Inductor's FX-graph cache key, so a change to any
ttftc source file, to the Config or to the autotune cache's content compiles afresh.

Two Inductor settings matter and are set by `inductor_config_patches`:
- freezing: weights become constants, which the fusing passes need (they concatenate and quantise weights at
  compile time). Without freezing (vLLM's default) the weights are graph inputs and those passes reject with
  that reason; attention still fuses.
- cpp.weight_prepack off: Inductor's freezing would otherwise rewrite every CPU linear into a oneDNN op on an
  opaque pre-packed weight *before* post-grad passes run, and no ttftc pass could match it. ttftc's own CPU
  lowerings run the GEMMs through oneDNN instead.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

import torch.fx as fx
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.lowering import lowerings
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ttftc.autotune.cache import AutotuneCache
from ttftc.codegen.lowered_ops import define_all as define_all_lowered_ops
from ttftc.config import Config
from ttftc.fx_utils import inline_function
from ttftc.pipeline import run_pipeline
from ttftc.report import Report
from ttftc.source_hash import ttftc_source_hash


class TtftcPostGradPass(CustomGraphPass):
    """ttftc's pipeline on Inductor's post-grad graph. Reports go to `reports` when a list is given."""

    def __init__(self, config: Optional[Config] = None, *, reports: Optional[list[Report]] = None,
                 autotune_cache=None):
        self.config = config or Config()
        self.reports = reports
        self.autotune_cache = autotune_cache
        define_all_lowered_ops()

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            raise ValueError("ttftc's post-grad pass needs a graph owned by a GraphModule (Inductor's always is)")
        # Passes transform real weights (concatenate, quantise); Inductor runs post-grad passes in fake mode.
        with unset_fake_temporarily():
            report = run_pipeline(gm, self.config, autotune_cache=self.autotune_cache, as_ops=True,
                                  notes=_weights_note(gm))
        decompose_for_inductor(gm)
        if self.reports is not None:
            self.reports.append(report)

    def uuid(self) -> str:
        parts = [ttftc_source_hash(), self.config.digest()]
        if self.config.autotune:
            cache = self.autotune_cache if self.autotune_cache is not None else AutotuneCache()
            parts.append(cache.content_digest())
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _weights_note(gm: fx.GraphModule) -> list[str]:
    constants = sum(1 for n in gm.graph.nodes if n.op == "get_attr")
    if constants:
        return []
    return ["no frozen weights in Inductor's graph (freezing off, or grad enabled): the passes that transform "
            "weights reject their matches; run under torch.no_grad() with torch._inductor.config.freezing=True"]


def decompose_for_inductor(gm: fx.GraphModule) -> None:
    """Replace each node Inductor would decompose rather than lower (the `_to_copy` casts ttftc's passes emit,
    for instance) by its decomposition, inlined in place.

    Post-grad graphs are already decomposed when Inductor's passes see them, and its lowering refuses an op that
    has a decomposition; nodes the passes add must reach it in that form too.
    """
    decompositions = select_decomp_table()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target not in lowerings and node.target in decompositions:
            inline_function(gm, node, decompositions[node.target], decompositions)
    gm.graph.lint()
    gm.recompile()


# The pass object vLLM (or any Inductor user) names in its config; the default Config, no report collection.
post_grad_pass = TtftcPostGradPass()


def inductor_config_patches(post_pass: TtftcPostGradPass) -> dict:
    return {"freezing": True, "cpp.weight_prepack": False, "post_grad_custom_post_pass": post_pass}


def compile_with_inductor(gm: fx.GraphModule, example_inputs: Sequence, post_pass: TtftcPostGradPass) -> Callable:
    return compile_fx(gm, list(example_inputs), config_patches=inductor_config_patches(post_pass))

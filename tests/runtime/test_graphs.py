"""CUDA graphs of a step's shape-static sections (runtime/graphs.py): when a section is captured,
what a replay returns and counts. On the CPU a stand-in graph replays by running the section again
on the graph's own inputs into its own outputs, which is what a CUDA graph's replay does; the GPU
test (test_gpu.py) runs the real graphs."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.engine import LLM
from duotile.runtime.graphs import Sections
from duotile.runtime.model_ops import Tally
from duotile.runtime.reference import Model
from duotile.runtime.sampler import SamplingParams


class StandIn:
    """A graph's replay on the CPU: the section run again, its results written into the outputs
    the capture returned, its op calls counted nowhere (the replay adds the captured ones)."""

    def __init__(self, holder, fn, inputs):
        self.holder, self.fn, self.inputs = holder, fn, inputs
        self.outputs = tuple(fn(*inputs))  # counted in the tally, as a capture's Python run is
        self.replayed = 0

    def replay(self):
        saved, self.holder.tally = self.holder.tally, Tally()
        for own, new in zip(self.outputs, self.fn(*self.inputs)):
            own.copy_(new)
        self.holder.tally = saved
        self.replayed += 1


def stand_in_capture(holder):
    made = []

    def capture(fn, inputs, pool):
        graph = StandIn(holder, fn, inputs)
        made.append(graph)
        return graph, graph.outputs, pool

    return capture, made


class Holder:
    def __init__(self):
        self.tally = Tally()


def _section(holder, reference_calls: list[bool]):
    """y = 2x + 1 and the row sums, counted as a generated 'hc_post' call (a reference one while
    ``reference_calls`` says so)."""
    def fn(x):
        holder.tally.count("hc_post", not (reference_calls and reference_calls.pop(0)))
        return 2 * x + 1, x.sum(-1)
    return fn


def test_a_section_runs_eagerly_once_then_replays_its_graph_with_the_new_inputs():
    holder = Holder()
    capture, made = stand_in_capture(holder)
    sections = Sections(max_tokens=8, capture=capture)
    fn = _section(holder, [])
    outs = []
    for i in range(4):
        x = torch.full((3, 5), float(i))
        outs.append(sections.run(holder.tally, ("ffn", 0), fn, x))
        torch.testing.assert_close(outs[-1][0], 2 * x + 1, rtol=0, atol=0)
        torch.testing.assert_close(outs[-1][1], x.sum(-1), rtol=0, atol=0)
    assert len(made) == 1 and made[0].replayed == 3 and sections.replays == 3
    assert outs[1][0] is outs[3][0]  # a replay returns the graph's own outputs
    assert holder.tally.snapshot() == {"hc_post": (4, 0)}  # once a call, captured or not
    assert sections.report() == "CUDA graphs: 1 captured, 3 replays"


def test_each_shape_and_section_has_its_own_graph_and_long_steps_stay_eager():
    holder = Holder()
    capture, made = stand_in_capture(holder)
    sections = Sections(max_tokens=4, capture=capture)
    fn = _section(holder, [])
    for _ in range(3):
        for layer, rows in ((0, 2), (1, 2), (0, 3), (0, 9)):
            x = torch.randn(rows, 5)
            assert torch.equal(sections.run(holder.tally, ("ffn", layer), fn, x)[0], 2 * x + 1)
    assert len(made) == 3  # (0, 2 rows), (1, 2 rows), (0, 3 rows); 9 rows > max_tokens
    assert holder.tally.snapshot() == {"hc_post": (12, 0)}


def test_a_section_that_ran_a_reference_op_is_captured_only_once_it_runs_on_kernels():
    holder = Holder()
    capture, made = stand_in_capture(holder)
    sections = Sections(max_tokens=8, capture=capture)
    fn = _section(holder, [True, True])  # the first two runs fall back to the reference
    x = torch.ones(2, 5)
    sections.run(holder.tally, ("ffn", 0), fn, x)
    sections.run(holder.tally, ("ffn", 0), fn, x)
    assert not made and "ran reference ops: hc_post" in sections.report()
    for _ in range(3):
        sections.run(holder.tally, ("ffn", 0), fn, x)
    assert len(made) == 1 and made[0].replayed == 2 and sections.eager == {}
    assert holder.tally.snapshot() == {"hc_post": (3, 2)}


def test_a_capture_that_raises_leaves_its_section_eager_and_says_why():
    holder = Holder()

    def capture(fn, inputs, pool):
        fn(*inputs)  # the Python run, counted, then the capture fails
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    sections = Sections(max_tokens=8, capture=capture)
    fn = _section(holder, [])
    for i in range(4):
        x = torch.full((2, 3), float(i))
        assert torch.equal(sections.run(holder.tally, ("ffn", 0), fn, x)[0], 2 * x + 1)
    assert holder.tally.snapshot() == {"hc_post": (4, 0)}  # the failed capture's run is not counted
    assert sections.report() == ("CUDA graphs: 0 captured, 0 replays; 1 section shape(s) eager (capture failed: "
                                 "RuntimeError: operation not permitted when stream is capturing)")


class StaleStandIn(StandIn):
    """A faulty graph: its replays leave the outputs of its capture as they were."""

    def replay(self):
        self.replayed += 1


def test_the_check_mode_names_the_section_whose_replay_differs_from_eager():
    from duotile.runtime.graphs import ReplayMismatch

    holder = Holder()
    made = []

    def capture(fn, inputs, pool):
        graph = StaleStandIn(holder, fn, inputs)
        made.append(graph)
        return graph, graph.outputs, pool

    checked = Sections(max_tokens=8, capture=capture, check=True)
    fn = _section(holder, [])
    for i in range(2):
        checked.run(holder.tally, ("ffn", 3), fn, torch.full((2, 3), float(i)))
    with pytest.raises(ReplayMismatch, match=r"section \('ffn', 3\) at input shapes \[\(2, 3\)\]: replay 2 "
                                             r"output 0 differs from the eager run \(6 of 6 elements"):
        checked.run(holder.tally, ("ffn", 3), fn, torch.full((2, 3), 2.0))
    # a right replay passes the check, and the check's eager runs are not counted
    holder = Holder()
    capture, _ = stand_in_capture(holder)
    checked = Sections(max_tokens=8, capture=capture, check=True)
    fn = _section(holder, [])
    for i in range(4):
        x = torch.full((2, 3), float(i))
        x[0, 0] = float("nan")  # NaN in and out: equal bits
        assert torch.equal(checked.run(holder.tally, ("ffn", 0), fn, x)[1].isnan(), torch.tensor([True, False]))
    assert holder.tally.snapshot() == {"hc_post": (4, 0)} and checked.replays == 3


def test_graphs_need_generated_kernels_on_a_cuda_device(ckpt_dir):
    from duotile.runtime.weights import Checkpoint

    ckpt = Checkpoint.open(ckpt_dir("v41-tiny"))
    with pytest.raises(ValueError, match="CUDA graphs replay generated kernels on a CUDA device"):
        Model(ckpt, kernels="generated", graphs=True)
    assert Model(ckpt, kernels="generated").ctx.sections is None  # the default: eager


def test_a_graph_keeps_alive_what_its_capture_held_after_the_cache_that_made_it_drops_it():
    """A graph's replays read the tensors its launches took at their capture's addresses; the
    sections keep those the ``hold`` collected with the graph (a dropped cache entry's memory would
    otherwise go to another tensor while the graph still reads it)."""
    import contextlib
    import weakref

    holder, cache = Holder(), {"copy": torch.ones(5)}
    collecting: list = []

    @contextlib.contextmanager
    def hold():
        collecting.append([])
        try:
            yield collecting[-1]
        finally:
            collecting.pop()

    def fn(x):
        holder.tally.count("hc_post", True)
        w = cache["copy"]
        if collecting:
            collecting[-1].append(w)  # what a kernel launch inside a capture adds
        return (x * w,)

    capture, made = stand_in_capture(holder)
    sections = Sections(max_tokens=8, capture=capture, hold=hold)
    for _ in range(2):
        sections.run(holder.tally, ("ffn", 0), fn, torch.full((2, 5), 3.0))
    gone = weakref.ref(cache.pop("copy"))
    assert gone() is not None and len(made) == 1
    (graph,) = sections._graphs.values()
    assert len(graph.held) == 1 and graph.held[0] is gone()


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_sections_from_graphs_give_the_eager_tokens_logits_and_op_counts(ckpt_dir, name):
    """Tiny V4.1 (single-pass mHC, each site's pre into the next site's collapse) and V4 (two pass,
    hash-routed layers reading the step's tokens): two requests of three and six tokens, with each
    layer's attention projections and FFN half from emulated graphs (``replayed.Recorded``: the
    capture's kernel launches and PyTorch ops run again on its tensors, no Python of the section)
    from their second call at a shape on, at two requests and then at one; the same tokens,
    bitwise the same logits and the same op report as eager."""
    from .replayed import recorded_capture

    params = [SamplingParams(max_tokens=3, ignore_eos=True, return_logits=True),
              SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True, return_logits=True)]
    prompts = [[3, 1, 4, 1], [2, 7]]
    eager = LLM(ckpt_dir(name), kernels="generated")
    want = eager.generate(prompts, params)
    graphed = LLM(ckpt_dir(name), kernels="generated")
    ctx = graphed.model.ctx
    capture, made = recorded_capture()
    ctx.sections = Sections(max_tokens=64, capture=capture, hold=ctx.ops.holding)
    got = graphed.generate(prompts, params)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    assert graphed.last_stats.ops == eager.last_stats.ops
    layers = graphed.config.num_hidden_layers
    # two sections a layer at each batch: two decode steps of two requests (warm, captured), three of
    # one (warm, captured, replayed)
    assert len(made) == 2 * 2 * layers and sum(g.replayed for g in made) == 3 * 2 * layers == ctx.sections.replays
    assert {(part, layer) for (part, layer), *_ in ctx.sections._graphs} == {
        (part, layer) for part in ("attention", "ffn") for layer in range(layers)}
    # each graph keeps the cached BF16 weight copies its launches read, and nothing else
    copies = {id(c) for _, _, c in ctx.ops._bf16.values() if c is not None}
    assert any(g.held for g in ctx.sections._graphs.values())
    assert all(id(t) in copies for g in ctx.sections._graphs.values() for t in g.held)


def test_the_emulated_graph_replays_the_captured_ops_on_their_tensors_and_no_python():
    """``replayed.Recorded``, the CPU emulation the model test runs: a replay runs the capture's
    PyTorch ops again on the capture's tensors (new inputs copied in, results in the same output
    tensors) and none of the section's Python; a host read during the capture raises, as a CUDA
    capture refuses a sync."""
    from .replayed import HostRead, Recorded

    runs = []

    def fn(x):
        runs.append(1)
        y = x * 2 + 1
        return y, y.sum(-1)

    own = torch.ones(2, 3)
    graph = Recorded(fn, (own,))
    y, s = graph.outputs
    own.copy_(torch.full((2, 3), 4.0))
    graph.replay()
    assert runs == [1] and graph.outputs[0] is y and torch.equal(y, torch.full((2, 3), 9.0))
    assert torch.equal(s, torch.full((2,), 27.0))
    with pytest.raises(HostRead, match="returned a host value inside a captured section"):
        Recorded(lambda x: (x * float(x.sum()),), (torch.ones(2),))

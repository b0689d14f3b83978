"""tree=auto (specbench/bench/costmodel.py): the smaller trees it predicts for are the trees the policies grow, the
choice follows the measured costs, and a run with tree=auto records its choice and stays lossless."""
import json

import pytest
import torch

from drafters.trees import DynamicTree, Level, StaticTree
from specbench.bench.costmodel import (DrafterCost, StepTrace, TargetCost, best_tree, candidates, kept_nodes,
                                      predicted_tau, timed_depths)
from specbench.bench.report.main import report
from specbench.bench.run import Runner
from specbench.decode.tree import node_depths
from specbench.errors import SpecbenchError

V = 12
TABLE = torch.randint(-3, 4, (V, V), generator=torch.Generator().manual_seed(0)).float()  # integer logits: ties


def expand(level: Level) -> torch.Tensor:
    return TABLE[level.tokens] + 0.1 * level.depth


def token_paths(tokens: list[int], parents: list[int], keep=None) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(tokens)) if keep is None else keep:
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.add(tuple(reversed(path)))
    return out


def test_replayed_on_a_complete_tree_every_smaller_dynamic_tree_is_exact():
    """A base tree that kept every node it expanded holds every smaller (depth, top-k, nodes) tree of the policy."""
    root = TABLE[3]
    big = DynamicTree(depth=4, topk=3, total_tokens=3 + 3 * 9 + 1).grow(root, expand)
    step = StepTrace(big.parents.tolist(), big.priority.tolist(), [])
    for d in range(1, 5):
        for k in (1, 2, 3):
            for n in range(1, k + (d - 1) * k * k + 1):
                small = DynamicTree(depth=d, topk=k, total_tokens=n + 1).grow(root, expand)
                assert token_paths(small.tokens.tolist(), small.parents.tolist()) == token_paths(
                    big.tokens.tolist(), step.parents, kept_nodes(step, d, n, k)), (d, k, n)


def test_the_best_nodes_of_the_base_tree_are_the_smaller_dynamic_tree():
    root = TABLE[3]
    big = DynamicTree(depth=4, topk=3, total_tokens=21).grow(root, expand)
    step = StepTrace(big.parents.tolist(), big.priority.tolist(), [])
    depths = node_depths(step.parents)
    checked = 0
    for d in range(1, 5):
        for n in range(1, 21):
            if sum(x <= d for x in depths) < n:
                continue  # the base tree spent those nodes deeper: the prediction is a lower bound there
            small = DynamicTree(depth=d, topk=3, total_tokens=n + 1).grow(root, expand)
            assert token_paths(small.tokens.tolist(), small.parents.tolist()) == token_paths(
                big.tokens.tolist(), step.parents, kept_nodes(step, d, n, 3)), (d, n)
            checked += 1
    assert checked > 40


def test_the_first_paths_of_a_static_list_are_the_smaller_static_tree():
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    big = StaticTree(paths).grow(TABLE[3], expand)
    step = StepTrace(big.parents.tolist(), big.priority.tolist(), [])
    for d in range(1, 5):
        for n in range(1, len(paths) + 1):
            cut = [p for p in paths if len(p) <= d][:n]
            small = StaticTree(cut).grow(TABLE[3], expand)
            assert token_paths(small.tokens.tolist(), small.parents.tolist()) == token_paths(
                big.tokens.tolist(), step.parents, kept_nodes(step, d, n))


def test_acceptance_of_a_smaller_tree_is_the_recorded_path_inside_it():
    # a chain of 4 (node order = preference) whose steps accepted 4, 2 and 0 nodes
    trace = [StepTrace([-1, 0, 1, 2], None, p) for p in ([0, 1, 2, 3], [0, 1], [])]
    assert predicted_tau(trace, 4, 4) == pytest.approx((5 + 3 + 1) / 3)
    assert predicted_tau(trace, 2, 2) == pytest.approx((3 + 3 + 1) / 3)
    assert predicted_tau(trace, 1, 1) == pytest.approx((2 + 2 + 1) / 3)


def costs(verify_per_token: float) -> tuple[TargetCost, DrafterCost]:
    """A chain drafter that always has 4 accepted: deeper is always better unless verifying is expensive."""
    target = TargetCost(prompt=80, prefill_s=0.0, context=100, sizes=[1, 5], seconds=[0.01, 0.01 + 4 * verify_per_token])
    trace = [{"parents": [-1, 0, 1, 2], "priority": None, "path": [0, 1, 2, 3]}] * 5
    drafter = DrafterCost(base={"kind": "dynamic", "depth": 4, "topk": 1, "total_tokens": 5},
                          draft=[[d, 1, 0.001] for d in range(1, 5)], overhead_s=0.0, prefill_s=0.0,
                          ar_overhead_s=0.0, ar_prefill_s=0.0, trace=trace)
    return target, drafter


def test_the_choice_follows_the_measured_costs():
    cheap, drafter = costs(0.0001)
    choice, grid = best_tree(cheap, drafter, 64)
    assert (choice.depth, choice.nodes) == (4, 4) and choice.speedup > 3
    dear, drafter = costs(0.05)  # each verified token costs 5x a whole one-token forward
    choice, _ = best_tree(dear, drafter, 64)
    assert (choice.depth, choice.nodes) == (1, 1) and choice.speedup < 1
    assert [(c.depth, c.nodes) for c in grid] == [(d, d) for d in range(1, 5)]  # top-1: depth d holds d nodes


def test_at_batch_a_draft_cost_timed_at_batch_1_is_paid_per_row():
    """decoding.batch_size=B with a cost file timed at batch 1 (rows drafting one after another): a draft time the
    batch-1 choice can afford shrinks the batch's speedup, and the same costs pick a shallower tree (here: 2 ms per
    drafted level against a 10 ms forward that batching does not slow)."""
    one, drafter = costs(0.0001)
    drafter.draft = [[d, 1, 0.002 * d] for d in range(1, 5)]
    at1, _ = best_tree(one, drafter, 64)
    eight = TargetCost(**{**one.__dict__, "batch": 8})
    at8, _ = best_tree(eight, drafter, 64)
    assert (at1.depth, at8.depth) == (4, 1) and at8.speedup < 1 < at1.speedup
    # the baseline's throughput grows 8x at the same forward time: the prediction is the batch's
    assert at8.tokens_per_s / at8.speedup == pytest.approx(8 * at1.tokens_per_s / at1.speedup)


def test_at_batch_a_draft_cost_timed_at_that_batch_is_paid_once_per_step():
    """A cost file calibrated at the run's B holds the batch's draft time per step (every row in the same forwards):
    the same 2 ms per level, paid once per step at B = 8, keeps the batch-1 choice and its speedup."""
    one, drafter = costs(0.0001)
    drafter.draft = [[d, 1, 0.002 * d] for d in range(1, 5)]
    at1, _ = best_tree(one, drafter, 64)
    drafter.batch = 8
    at8, _ = best_tree(TargetCost(**{**one.__dict__, "batch": 8}), drafter, 64)
    assert (at1.depth, at8.depth) == (4, 4) and at8.speedup == pytest.approx(at1.speedup)


def test_draft_times_between_the_measured_depths_are_linear():
    """A policy 6 levels deep, its draft timed at depths 1, 4 and 6 (timed_depths): the others are read on the lines
    between, and every depth is a candidate."""
    assert timed_depths(6, 3) == [1, 4, 6] and timed_depths(3, 3) == [1, 2, 3] and timed_depths(6, 9) == list(range(1, 7))
    assert timed_depths(1, 3) == [1] and timed_depths(8, 2) == [1, 8]
    target, drafter = costs(0.0001)
    drafter.base = {"kind": "dynamic", "depth": 6, "topk": 2, "total_tokens": 11}
    drafter.draft = [[1, 1, 0.010], [4, 1, 0.040], [6, 1, 0.080], [1, 2, 0.020], [4, 2, 0.050], [6, 2, 0.090]]
    assert drafter.draft_s(2, 1) == pytest.approx(0.020) and drafter.draft_s(5, 1) == pytest.approx(0.060)
    assert drafter.draft_s(4, 2) == pytest.approx(0.050) and drafter.draft_s(3, 2) == pytest.approx(0.040)
    assert {(d, k) for d, k, _ in candidates(drafter.base, drafter)} == {(d, k) for d in range(1, 7) for k in (1, 2)}
    with pytest.raises(SpecbenchError, match="no draft time measured"):
        drafter.draft_s(3, 4)


@pytest.mark.slow
def test_calibration_at_batch_times_the_rows_drafted_together():
    from specbench.bench.costmodel import calibrate_drafter
    from tests.test_conformance import PROMPTS, make_drafter, target_for

    t = target_for()
    base = {"kind": "dynamic", "depth": 3, "topk": 2, "total_tokens": 6}
    cost = calibrate_drafter(t, lambda tree: make_drafter("eagle2", t, *(f"tree.{k}={v}" for k, v in tree.items()
                                                                      if k != "kind")),
                             base, PROMPTS, 12, [1], batch=3, depths=2)
    # two depths timed per width (the first and the last), the middle one read between them
    assert cost.batch == 3 and {(d, k) for d, k, _ in cost.draft} == {(d, k) for d in (1, 3) for k in (1, 2)}
    assert all(t > 0 for *_, t in cost.draft) and cost.trace and cost.overhead_s is not None
    for k in (1, 2):
        assert min(cost.draft_s(1, k), cost.draft_s(3, k)) <= cost.draft_s(2, k) <= max(cost.draft_s(1, k),
                                                                                        cost.draft_s(3, k))


@pytest.mark.slow
def test_a_run_with_tree_auto_records_its_choice_and_is_lossless(make_cfg, tmp_path):
    cfg = make_cfg("drafter=eagle2", "drafter.checkpoint=null", "tree=auto", "tree.questions=2",
                   "tree.new_tokens=12", f"model.cache_dir={tmp_path / 'cache'}", "dataset.limit=1",
                   "out.experiment=tree_auto")
    run_dir = Runner(cfg).execute()
    run = json.loads(run_dir.run_json.read_text())
    auto = run["tree_auto"]
    assert auto["chosen"]["kind"] == "dynamic" and 1 <= auto["chosen"]["depth"] <= 6
    # the base tree, 60 tokens verified: the root and 59 drafted (the authors' count)
    assert auto["predicted"]["tokens_per_s"] > 0 and {"1", "60"} <= set(auto["verify_s"])
    summary = json.loads(run_dir.summary_path.read_text())
    assert summary["lossless"]["matches"] == summary["lossless"]["compared"] > 0
    files = list((tmp_path / "cache" / "costmodel").rglob("*.json"))
    assert len(files) == 3  # the target's cost, the drafter's and its draft time at the run's context, cached
    scale = auto["draft_context_scale"]
    assert scale["scale"] == pytest.approx(scale["run_s"] / scale["calibration_s"]) and scale["scale"] > 0
    Runner(cfg).make_drafter(cfg.drafter)  # a second resolution reads the cache
    assert len(list((tmp_path / "cache" / "costmodel").rglob("*.json"))) == 3
    # the experiment's table: the auto run's chosen tree and predicted speedup next to its measured one
    written = report(tmp_path / "results")
    table = (tmp_path / "results" / "tree_auto" / "auto.tiny.md").read_text()
    assert written and "tree=auto" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith("| eagle2 | jsonl |"))
    chosen = auto["chosen"]
    assert f"depth {chosen['depth']}, top-k {chosen['topk']}, {chosen['total_tokens']} tokens" in row
    assert f"{auto['predicted']['speedup']:.2f}x" in row


@pytest.mark.slow
@pytest.mark.parametrize(("drafter", "over", "arg"), [
    ("pld", [], "num_pred_tokens"),
    ("sd", ["drafter.checkpoint=null"], "gamma"),
    ("medusa", ["drafter.checkpoint=null", "drafter.tree=[[0],[1],[0,0],[0,1],[0,0,0]]"], "tree"),
    ("eagle", ["drafter.checkpoint=null"], "tree"),
])
def test_tree_auto_tunes_drafters_without_a_dynamic_policy(make_cfg, tmp_path, drafter, over, arg):
    """pld and sd (chains: their length), medusa (its own sparse tree) and eagle (EAGLE-1's static list, its
    paper_tree): tree=auto cuts each one's own drafts to their first n paths of depth <= d; the run is lossless,
    named apart from tree=paper's, and the drafter is built with the cut. tree=paper is the drafter's own tree."""
    common = [f"drafter={drafter}", *over, "tree.questions=1", "tree.new_tokens=10", "dataset.limit=1",
              f"model.cache_dir={tmp_path / 'cache'}", "out.experiment=tree_auto"]
    auto_cfg = make_cfg(*common, "tree=auto")
    paper_cfg = make_cfg(*[c for c in common if not c.startswith("tree.")], "tree=paper")
    runner = Runner(auto_cfg)
    run_dir = runner.execute()
    auto = json.loads(run_dir.run_json.read_text())["tree_auto"]
    chosen, base = auto["chosen"], auto["base"]
    assert chosen["kind"] == base["kind"] == "static"
    assert chosen["paths"] == [p for p in base["paths"] if len(p) <= auto["predicted"]["depth"]][: len(chosen["paths"])]
    summary = json.loads(run_dir.summary_path.read_text())
    assert summary["lossless"]["matches"] == summary["lossless"]["compared"] > 0
    built = runner.make_drafter(auto_cfg.drafter)
    if arg == "tree" and drafter == "medusa":
        assert sorted(map(tuple, built.paths)) == sorted(map(tuple, chosen["paths"]))
    elif arg == "tree":
        assert built.policy.max_nodes == len(chosen["paths"])
    else:
        assert getattr(built, arg) == len(chosen["paths"])
    paper = Runner(paper_cfg)
    assert paper.run_dir_for(paper_cfg.drafter)[0].path != run_dir.path
    if drafter == "eagle":  # tree=paper is EAGLE-1's static list: the same run as naming it
        static_cfg = make_cfg(*[c for c in common if not c.startswith("tree.")], "tree=static")
        assert paper.run_dir_for(paper_cfg.drafter)[0].path == Runner(static_cfg).run_dir_for(static_cfg.drafter)[0].path


def test_the_verify_cost_is_timed_on_the_engines_path():
    """At batch B the forwards go through generate_batch's preallocated cache and per-row masks; compiled, through the
    static cache, with room for the run's context (past its first 1,024 positions too) and the largest bucket."""
    from specbench.bench.costmodel import time_verify
    from specbench.decode.target import TargetModel
    from tests.helpers import tiny_llama

    eager = TargetModel(tiny_llama(layers=2), None, torch.device("cpu"), "tiny")
    at2 = time_verify(eager, 8, 12, [1, 4], repeats=1, batch=2)
    assert at2.batch == 2 and all(t > 0 for t in at2.seconds)
    compiled = TargetModel(tiny_llama(layers=2), None, torch.device("cpu"), "tiny", compile="aot_eager")
    long = time_verify(compiled, 8, 1100, [1, 40], repeats=1)
    assert all(t > 0 for t in long.seconds)


def test_the_verify_sizes_are_timed_in_rounds():
    """Every round times each size once (round 0 the warm-up): a host whose speed drifts during a calibration then
    shifts every size alike, where sizes timed one after another made verify(Q) / verify(1) the drift's."""
    from specbench.bench.costmodel import time_verify
    from specbench.decode.target import TargetModel
    from tests.helpers import tiny_llama

    order = []

    class Spy(TargetModel):
        def forward(self, input_ids, cache, position_ids=None, **kw):
            if position_ids is not None:  # a timed forward (the prefills give none)
                order.append(input_ids.shape[1])
            return super().forward(input_ids, cache, position_ids=position_ids, **kw)

    target = Spy(tiny_llama(layers=2), None, torch.device("cpu"), "tiny")
    cost = time_verify(target, 8, 12, [1, 3, 6], repeats=2)
    assert order == [1, 3, 6] * 3 and cost.sizes == [1, 3, 6] and len(cost.seconds) == 3

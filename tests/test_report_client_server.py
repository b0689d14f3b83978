"""MoA's client-server tables (specbench/bench/report/client_server.py, issue 78) on small synthetic run records:
Table 3's speeds, τ and calls per link, Table 7's bytes beside the formula computed from the run's own M, A and
crossing, Table 4's pass@1 through a scorer with the lower bound and the finer `kept after the cut` score, the figure."""
import json
from pathlib import Path

from specbench.bench.report.cells import MISSING
from specbench.bench.report.client_server import (
    case_key, client_server_report, formula, kept_after_cut, needs_of)
from specbench.bench.report.tables import ClientServerTable, experiment_report

TARGET = {"0": list(range(1, 21)), "1": list(range(30, 50))}  # the target's greedy answers (the baseline run)
MOA_NEEDS = [["lsa0", 192], ["lsa1", 192]]


def _run(exp: Path, name: str, drafter: str, *, deploy: str = "local", link: str = "none", cut: int | None = None,
         speed: float = 1.0, answers: dict | None = None, cuts: dict | None = None, needs=None,
         answered: list[int] | None = None) -> None:
    """One finished run: run.json, summary.json, records.jsonl (one record per question, turn 0)."""
    d = exp / name
    d.mkdir(parents=True)
    answers = answers or TARGET
    cfg = {"model": {"name": "tiny", "dtype": "float32"}, "decoding": {"max_new_tokens": 20, "batch_size": 1},
           "dataset": {"name": "humaneval", "limit": 2}, "deploy": {"name": deploy},
           "link": {"name": link, "disconnect_after_tokens": cut},
           "drafter": {"name": drafter, "tree": {"kind": "dynamic", "depth": 6, "topk": 8, "total_tokens": 62}}}
    head = {"config": cfg, "date": "2026-12-01T00:00:00+00:00", "env": {"cpu": "test cpu"}, "git": {"commit": "abc1234"}}
    split = deploy == "client_server" and drafter != "none"
    answered = answered or [2, 1]  # tokens per answer of each step (A)
    records = []
    for q, ids in answers.items():
        rec = {"question_id": q, "turn": 0, "repeat": 0, "new_token_ids": ids, "tree_sizes": [62, 60]}
        if split:
            rec["split"] = {"answer_tokens_per_step": answered, "disconnected_at": (cuts or {}).get(q),
                            **({"needs": needs} if needs is not None else {})}
        records.append(rec)
    summary = {"run": name, "drafter": drafter, "dataset": "humaneval", "temperature": 0.0, "tau_micro": 1.5,
               "tokens_per_s": {"mean": speed}, "lossless": {"compared": 2, "matches": 2}}
    if split:
        summary["split"] = {"calls_per_answer": {"mean": 10.0}, "bytes_up_per_step": 256.0,
                            "bytes_down_per_step": 600.0, "prompt_bytes_up_per_answer": {"mean": 400.0},
                            "prefill_bytes_down_per_answer": {"mean": 5000.0}, "draft_ms_per_step": 5.0,
                            "server_ms_per_step": 7.0, "link_ms_per_step": 20.0 if link == "5g" else 40.0,
                            "round_trip_ms_per_step": 27.0}
    (d / "run.json").write_text(json.dumps(head))
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _table() -> ClientServerTable:
    return ClientServerTable("table", "humaneval", ("moa", "sd_tree"), ("5g", "4g"), (5, 10))


def _rows(md: str, n: int = 1) -> dict[str, list[str]]:
    """The n-th table of a markdown file, method -> cells."""
    tables, cur = [], None
    for line in md.splitlines():
        if line.startswith("| ") and cur is None:
            cur = []
            tables.append(cur)
        elif not line.startswith("|"):
            cur = None
        if cur is not None and line.startswith("| "):
            cur.append([c.strip() for c in line.strip("|").split("|")])
    return {r[0]: r[1:] for r in tables[n - 1][1:]}


def _scorer(head: dict):
    """A stand-in for HumanEval's tests: an answer passes when it holds the target's last token of question 0 (19),
    or question 1's whole answer."""
    def score(q: str, ids: list[int]) -> tuple[bool, str]:
        ok = 19 in ids if q == "0" else ids == TARGET["1"]
        return ok, "passed" if ok else "failed: AssertionError"
    return score


def _likelihood(head: dict):
    """A stand-in for the target's log-likelihood: -1 nat for each token after the cut that is not the target's at
    that position, 0 for each that is."""
    def loglik(q: str, ids: list[int], cut: int) -> tuple[float, int]:
        own = ids[cut:]
        return -float(sum(a != b for a, b in zip(own, TARGET[q][cut:]))), len(own)
    return loglik


def test_tables_3_7_and_4_from_the_runs(tmp_path):
    exp = tmp_path / "moa_client_server"
    _run(exp, "base", "none", speed=4.0)
    _run(exp, "moa_local", "moa", speed=3.0)
    _run(exp, "moa_5g", "moa", deploy="client_server", link="5g", speed=2.0, needs=MOA_NEEDS)
    _run(exp, "moa_4g", "moa", deploy="client_server", link="4g", speed=1.5, needs=MOA_NEEDS)
    # cut at 5 (the answer arrived to 6 on question 0): question 0 kept 4 more of the target's tokens, then differs
    moa5 = {"0": TARGET["0"][:10] + [99] * 10, "1": TARGET["1"][:5] + [98] * 15}
    _run(exp, "moa_b5", "moa", deploy="client_server", cut=5, needs=MOA_NEEDS, answers=moa5, cuts={"0": 6, "1": 5})
    _run(exp, "moa_b10", "moa", deploy="client_server", cut=10, needs=MOA_NEEDS, cuts={"0": 10, "1": 11})
    _run(exp, "sd_5g", "sd_tree", deploy="client_server", link="5g", speed=2.5, needs=[], answered=[1, 1])
    written = client_server_report(exp, _table(), figure=True, scorer_for=_scorer, likelihood_for=_likelihood)
    assert {p.name for p in written} == {"table3.tiny.md", "table7.tiny.md", "table4.tiny.md", "table4.tiny.json",
                                         "table4.tiny.loglik.json", "client_server.tiny.png"}
    assert (exp / "client_server.tiny.pdf").is_file()

    t3 = (exp / "table3.tiny.md").read_text()
    rows = _rows(t3)
    # 5G, 4G, single-device, τ, calls, τ x calls, lossless
    assert rows["moa"] == ["2.00", "1.50", "3.00", "1.50", "10.0", "15.0", "4/4"]
    assert rows["sd_tree"] == ["2.50", MISSING, MISSING, "1.50", "10.0", "15.0", "2/2"]
    assert rows["none (the target alone)"][2] == "4.00"
    assert "| moa | 5g | 5.0 | 7.0 | 20.0 | 27.0 |" in t3 and "| moa | 4g | 5.0 | 7.0 | 40.0 | 27.0 |" in t3

    t7 = _rows((exp / "table7.tiny.md").read_text())
    # M = 61 nodes, A = 1.5: up 4M = 244, down 3A + A·384 = 580.5
    assert t7["moa"] == ["lsa0 [192], lsa1 [192]", "61.0", "1.50", "256", "244", "600", "580", "3A + 2A·192", "400",
                         "5,000"]
    assert t7["sd_tree"][0] == "nothing" and t7["sd_tree"][6:8] == ["3", "3A"]

    t4 = (exp / "table4.tiny.md").read_text()
    passed = _rows(t4)
    # B = 5: question 0's answer stops before 19 -> fails; B = 10: the target's own answers -> both pass
    assert passed["moa"] == ["0/2 (0%)", "2/2 (100%)", "2/2 (100%)"]
    assert passed["sd_tree"] == [MISSING, MISSING, "2/2 (100%)"]
    assert passed["stop at B (lower bound)"] == ["0/2 (0%)", "0/2 (0%)", "2/2 (100%)"]
    kept = _rows(t4, 2)
    # B = 5: question 0 kept 4 of 14 after its cut at 6, question 1 none of 15 after 5
    assert kept["moa"] == ["14% (4/29; cut at 5,6)", "100% (19/19; cut at 10,11)", "100% (no cut)"]
    assert "Before the cut every answer equals the target's." in t4
    ll = _rows(t4, 3)
    # B = 5: question 0's 14 tokens after 6, 4 kept then 10 not; question 1's 15 after 5, none kept: -25 / 29
    assert ll["moa"] == ["-0.86 (29)", "0.00 (19)"] and ll["sd_tree"] == [MISSING, MISSING]
    assert ll["the target's own greedy continuation"] == ["0.00 (30)", "0.00 (20)"]
    executed = json.loads((exp / "table4.tiny.json").read_text())
    assert {(e["row"], e["B"], e["question"]) for e in executed if not e["passed"]} >= {("moa", "5", "0")}

    # a re-render reads the kept log-likelihoods: the target is not run again, the table the same
    first = (exp / "table4.tiny.md").read_text()

    def no_target(head: dict):
        raise AssertionError("the target was run again")
    client_server_report(exp, _table(), figure=False, scorer_for=_scorer, likelihood_for=no_target)
    assert (exp / "table4.tiny.md").read_text() == first
    # a changed answer is computed afresh (and only it: the stand-in counts its calls)
    calls = []

    def counted(head: dict):
        fn = _likelihood(head)
        return lambda *a: calls.append(a) or fn(*a)
    (exp / "moa_b10").rename(tmp_path / "moa_b10")
    _run(exp, "moa_b10", "moa", deploy="client_server", cut=10, needs=MOA_NEEDS, cuts={"0": 10, "1": 11},
         answers={"0": TARGET["0"][:12] + [97] * 8, "1": TARGET["1"]})
    client_server_report(exp, _table(), figure=False, scorer_for=_scorer, likelihood_for=counted)
    assert [c[0] for c in calls] == ["0"] and _rows((exp / "table4.tiny.md").read_text(), 3)["moa"][1] == "-0.42 (19)"
    (exp / "moa_b10").rename(tmp_path / "moa_b10_changed")
    (tmp_path / "moa_b10").rename(exp / "moa_b10")

    # without a scorer (no harness) the pass@1 cells stay missing, the finer score does not
    client_server_report(exp, _table(), figure=False, scorer_for=None, likelihood_for=None)
    t4 = (exp / "table4.tiny.md").read_text()
    assert _rows(t4)["moa"] == [MISSING] * 3 and _rows(t4, 2)["moa"][0].startswith("14%")


def test_an_answer_that_differs_before_the_cut_is_named(tmp_path):
    exp = tmp_path / "moa_client_server"
    _run(exp, "base", "none")
    bad = {"0": [7] + TARGET["0"][1:], "1": TARGET["1"]}
    _run(exp, "moa_b5", "moa", deploy="client_server", cut=5, needs=MOA_NEEDS, answers=bad, cuts={"0": 5, "1": 5})
    client_server_report(exp, _table(), figure=False, scorer_for=None, likelihood_for=None)
    assert "moa at B = 5: 1 answer(s) differ from the target's before the cut" in (exp / "table4.tiny.md").read_text()


def test_the_pieces():
    assert kept_after_cut([1, 2, 3, 9, 5], [1, 2, 3, 4, 5], 1) == (2, 4)
    assert kept_after_cut([1, 2], [1, 2, 3], 2) == (0, 1)
    assert formula([]) == "3A" and formula([("hidden", 576)]) == "3A + A·576"
    assert formula([("lsa0", 192), ("lsa1", 192), ("k29", 192), ("v29", 192)]) == "3A + 4A·192"
    assert formula([("a", 3), ("b", 5)]) == "3A + A·(3 + 5)"
    assert needs_of([{"split": {}}]) is None and needs_of([{"split": {"needs": [["h", 4]]}}]) == [("h", 4)]
    head = lambda deploy, link, cut: {"config": {"deploy": {"name": deploy},  # noqa: E731
                                                 "link": {"name": link, "disconnect_after_tokens": cut}}}
    s = {"drafter": "moa", "dataset": "humaneval"}
    assert case_key(s, head("local", "none", None))[2] == "local"
    assert case_key(s, head("client_server", "4g", None))[2] == "4g"
    assert case_key(s, head("client_server", "none", 25))[2] == "B=25"
    assert case_key({**s, "drafter": "none"}, head("client_server", "5g", None))[2] == "local"


def test_the_experiment_declares_tables_3_4_and_7():
    (table,), figures = experiment_report("moa_client_server")
    assert isinstance(table, ClientServerTable) and figures == ["client_server"]
    assert table.drafters == ("moa", "moa_tli1", "eagle2", "sd_tree") and table.links == ("5g", "4g")
    assert table.cuts == (1, 10, 25, 50)


def test_each_case_of_the_sweep_composes_to_its_deploy_and_link():
    """conf/split_case/: the rows of moa_client_server's one sweep compose to the deploy, link and cut they name, over
    the experiment's HumanEval and MoA tree."""
    from hydra import compose, initialize_config_dir

    from specbench.core.cli import CONF_DIR
    from specbench.core.config import register_schema

    register_schema()
    want = {"5g": ("client_server", "5g", None), "4g": ("client_server", "4g", None), "local": ("local", "none", None),
            **{f"cut{b}": ("client_server", "none", b) for b in (1, 10, 25, 50)}}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for case, (deploy, link, cut) in want.items():
            cfg = compose(config_name="config", overrides=["+experiment=moa_client_server", f"split_case={case}"])
            assert (cfg.deploy.name, cfg.link.name, cfg.link.disconnect_after_tokens) == (deploy, link, cut), case
            assert cfg.dataset.name == "humaneval" and cfg.tree.total_tokens == 62
    # the sweep runs every case of the group
    import yaml

    exp = yaml.safe_load((CONF_DIR / "experiment" / "moa_client_server.yaml").read_text())
    cases = set(exp["hydra"]["sweeper"]["params"]["split_case"].split(","))
    assert cases == {p.stem for p in (CONF_DIR / "split_case").glob("*.yaml")} == set(want)

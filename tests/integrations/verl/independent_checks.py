"""Checks of a replay run against computations that share no code with verl_replay's: the scan's
log-probs, Drift and Headroom from a plain transformers forward of the weights the scan ran under,
the gate's rules replayed from those numbers, and each optimiser step's gradient against autograd of
the mixed loss written out here in float64.

Sources: the run's event log, the group buffer its last checkpoint saved (which groups had which
tokens, cross-checked against the fresh rows verl itself put in the update), the update audit
(``replay.audit_dir``: every micro-batch's rows, and per optimiser step the weights its gradient was
taken at and that gradient, ``*.grad``). The formulas below are the definitions, written out again
on purpose: they must not call the package's own Headroom/Drift/loss code.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch
from replay_audit import ELITE, FRESH, GROUP_REPLAY, AuditedRow

CLIP_LOW = CLIP_HIGH = 0.2  # verl's actor defaults (clip_ratio_low/high, dual-clip clip_ratio_c)
CLIP_C = 3.0


def read_gradient_records(audit: Path) -> list[dict[str, Any]]:
    """One record per optimiser step, in order: weights before the step and the accumulated gradient."""
    records = [torch.load(path) for path in sorted(Path(audit).glob("*.grad"))]
    records.sort(key=lambda r: r["replay_optimizer_step"])
    assert [r["replay_optimizer_step"] for r in records] == list(range(len(records))), "an optimiser step is missing"
    return records


@functools.lru_cache(maxsize=2)
def _base_model(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir).eval().to(dtype)


def tiny_model(model_dir, weights: dict[str, torch.Tensor], dtype: torch.dtype):
    """The tiny model (the class verl's engine trains: the image-text model; a text row needs only its
    language model) in ``dtype`` with the recorded weights; tied weights follow their source."""
    model = _base_model(str(model_dir), dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    tied = (
        {name for name in missing if "lm_head" in name} if model.config.get_text_config().tie_word_embeddings else set()
    )
    assert set(missing) == tied, f"weights not recorded: {sorted(set(missing) - tied)[:5]}"
    model.zero_grad(set_to_none=True)
    return model


def rows_log_probs(model, pairs: list[tuple], temperature: float = 1.0) -> list[torch.Tensor]:
    """Teacher-forced log-probs of each response after its prompt ([T] each), the rows in one forward,
    right-padded: a causal model's outputs at a row's own positions do not see what follows them."""
    sequences = [torch.cat([torch.as_tensor(p), torch.as_tensor(r)]).long() for p, r in pairs]
    ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)  # [B, L_max]
    log_probs = torch.log_softmax(model(input_ids=ids, use_cache=False).logits / temperature, dim=-1)  # [B, L, V]
    out = []
    for b, (prompt, response) in enumerate(pairs):
        start, response = len(prompt), torch.as_tensor(response).long()
        out.append(log_probs[b, start - 1 : start - 1 + response.numel()].gather(-1, response[:, None])[:, 0])
    return out


def drift_l2(new: list[torch.Tensor], gen: list[torch.Tensor]) -> float:
    r = torch.cat([(n.double() - g.double()) for n, g in zip(new, gen, strict=True)])
    return math.sqrt(float((r * r).mean()))


def headroom_sign(log_probs: list[torch.Tensor], advantages: list[float]) -> float:
    """Mean over responses with A != 0 of the mean over tokens of (1 - p) for A > 0, p for A < 0."""
    values = []
    for lp, a in zip(log_probs, advantages, strict=True):
        if a == 0:
            continue
        p = lp.double().exp()
        values.append(float((1 - p).mean() if a > 0 else p.mean()))
    return sum(values) / len(values) if values else 0.0


def _group_rows(group, fresh_by_tokens: dict[tuple, list[AuditedRow]]) -> list[AuditedRow]:
    """The fresh rows verl trained on at the group's birth step, one per stored response: what the
    buffer holds for it must be exactly what those rows carried (tokens, rollout log-probs, A)."""
    prompt = tuple(group.prompt_ids.tolist())
    ids, lengths = group.response_ids, group.response_lengths.tolist()
    gen, offsets = group.gen_log_probs, [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    rows = []
    for i in range(len(lengths)):
        response = tuple(ids[offsets[i] : offsets[i + 1]].tolist())
        births = [r for r in fresh_by_tokens.get((prompt, response), []) if r.global_step == group.birth_step]
        assert births, f"group {group.group_id}: response {i} is no fresh row of step {group.birth_step}"
        row = births[0]
        torch.testing.assert_close(row.rollout_log_probs, gen[offsets[i] : offsets[i + 1]], rtol=1e-5, atol=1e-6)
        assert float(row.advantage[0]) == float(group.advantages[i])
        rows.append(row)
    return rows


def check_scan_and_gate(
    events: list[dict],
    buffer_groups: dict[int, Any],
    rows: list[AuditedRow],
    gradients: list[dict],
    model_dir,
    *,
    tau: float,
    k_rep: int,
    temperature: float = 1.0,
    boundary: float = 1e-5,
) -> dict[str, int]:
    """Every scan of the run recomputed and its decisions replayed rule by rule:

    - the scanned groups' log-probs from a plain transformers forward, each row alone, of the weights
      the scan ran under (the weights of the global step's first optimiser step: the scan runs before
      it, after the previous step's last), Drift and Headroom from the definitions; equal to the event
      log's (the scan forwards whole chunks, padded: so chunked equals one by one);
    - candidates: the groups admitted before the step, in the order of their cached Headroom (the
      initial Headroom recomputed from the stored tokens, replaced by each scan's recomputed value),
      newer birth step first on ties, then admission order; the scan follows that order;
    - accepted exactly when the recomputed drift <= tau (groups within ``boundary`` of tau are left
      to the logged drift, which the recomputation matches);
    - the stop rule: the scan ends at the K_rep-th acceptance, else after the last candidate;
    - what the update trained on as replayed rows in that step: exactly the accepted groups, every
      response of each.
    Returns the counts of accepted and rejected scans."""
    fresh_by_tokens: dict[tuple, list[AuditedRow]] = defaultdict(list)
    for row in rows:
        if row.source == FRESH:
            fresh_by_tokens[row.tokens].append(row)
    first_weights = {}
    for record in gradients:
        first_weights.setdefault(record["replay_global_step"], record["weights"])
    ingress = {e["group_id"]: e for e in events if e["event"] == "ingress"}
    evicted = {e["group_id"]: e["step"] for e in events if e["event"] == "evict"}
    cached: dict[int, float] = {}
    group_rows: dict[int, list[AuditedRow]] = {}
    for gid, event in ingress.items():
        if gid not in buffer_groups:
            continue
        group_rows[gid] = _group_rows(buffer_groups[gid], fresh_by_tokens)
        advantages = [float(r.advantage[0]) for r in group_rows[gid]]
        cached[gid] = headroom_sign([r.rollout_log_probs for r in group_rows[gid]], advantages)
        assert cached[gid] == _approx(event["initial_headroom"]), (gid, cached[gid], event)
    scans_by_step: dict[int, list[dict]] = defaultdict(list)
    for event in events:
        if event["event"] == "scan":
            scans_by_step[event["step"]].append(event)
    counts = {"accepted": 0, "rejected": 0, "recomputed": 0}
    for step in sorted(scans_by_step):
        scans = sorted(scans_by_step[step], key=lambda e: e["rank"])
        assert [e["rank"] for e in scans] == list(range(1, len(scans) + 1))
        candidates = [g for g, e in ingress.items() if e["step"] < step and evicted.get(g, step) >= step]
        assert all(g in cached for g in candidates), "a candidate is missing from the saved buffer"
        order = sorted(candidates, key=lambda g: (-cached[g], -ingress[g]["birth_step"], g))
        assert [e["group_id"] for e in scans] == order[: len(scans)], (step, scans, order)
        model = tiny_model(model_dir, first_weights[step], torch.float64)
        accepted = []
        with torch.no_grad():
            for event in scans:
                members = group_rows[event["group_id"]]
                new = rows_log_probs(model, [r.tokens for r in members], temperature)
                drift = drift_l2(new, [r.rollout_log_probs for r in members])
                headroom = headroom_sign(new, [float(r.advantage[0]) for r in members])
                assert drift == _approx(event["drift"]), (event, drift)
                assert headroom == _approx(event["headroom_after"]), (event, headroom)
                assert event["headroom_before"] == _approx(cached[event["group_id"]])
                counts["recomputed"] += 1
                decided = drift if abs(drift - tau) > boundary else event["drift"]
                assert event["accepted"] == (decided <= tau), (event, drift, tau)
                cached[event["group_id"]] = headroom
                if event["accepted"]:
                    accepted.append(event["group_id"])
        counts["accepted"] += len(accepted)
        counts["rejected"] += len(scans) - len(accepted)
        if len(accepted) == k_rep:
            assert scans[-1]["accepted"], "scanning went on after the K_rep-th acceptance"
        else:
            assert len(accepted) < k_rep and len(scans) == len(candidates), "scanning stopped early"
        trained: dict[int, set] = defaultdict(set)
        for row in rows:
            if row.source == GROUP_REPLAY and row.global_step == step:
                trained[row.group_id].add(row.tokens)
        assert sorted(trained) == sorted(accepted), (step, sorted(trained), accepted)
        for gid in accepted:
            assert trained[gid] == {r.tokens for r in group_rows[gid]}
    return counts


def _approx(value: float):
    import pytest

    return pytest.approx(value, rel=1e-4, abs=1e-6)


def independent_mixed_loss(
    model, micro_batches: list[dict], *, mu: float, elite: bool
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = (1 - mu) * L_GRPO + mu * L_NLL over one optimiser step's rows, in the model's dtype:
    L_GRPO = sum over the GRPO tokens of the dual-clipped PPO loss (times the rollout IS weight) /
    their count; L_NLL = mean over the elite rows of each row's mean token NLL."""
    grpo_sum, grpo_tokens, nll_sum, elite_rows = 0.0, 0, 0.0, 0
    rows = [  # verl's synthetic padding rows (no valid token) carry nothing
        (record, i, int(record["response_mask"][i].sum()))
        for record in micro_batches
        for i in range(record["responses"].shape[0])
        if int(record["response_mask"][i].sum()) > 0
    ]
    pairs = [(record["prompts"][i], record["responses"][i][:valid]) for record, i, valid in rows]
    for (record, i, valid), lp in zip(rows, rows_log_probs(model, pairs), strict=True):
        if int(record["replay_source"][i]) == ELITE:
            nll_sum = nll_sum + (-lp).mean()
            elite_rows += 1
            continue
        old = record["old_log_probs"][i][:valid].to(lp.dtype)
        advantage = record["advantages"][i][:valid].to(lp.dtype)
        ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
        pg1 = -advantage * ratio
        pg2 = -advantage * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
        clipped = torch.maximum(pg1, pg2)
        pg = torch.where(advantage < 0, torch.minimum(-advantage * CLIP_C, clipped), clipped)
        if "rollout_is_weights" in record:
            pg = pg * record["rollout_is_weights"][i][:valid].to(lp.dtype)
        grpo_sum = grpo_sum + pg.sum()
        grpo_tokens += valid
    grpo = grpo_sum / max(grpo_tokens, 1)
    if not elite:
        return grpo, {"grpo_tokens": grpo_tokens, "elite_rows": 0}
    nll = nll_sum / elite_rows if elite_rows else 0.0
    return (1 - mu) * grpo + mu * nll, {"grpo_tokens": grpo_tokens, "elite_rows": elite_rows}


def check_gradients(
    audit: Path,
    model_dir,
    *,
    mu: float,
    elite: bool,
    steps: Optional[list[int]] = None,
    rtol: float = 2e-3,
) -> list[float]:
    """Each audited optimiser step's gradient (the real worker's, accumulated over its micro-batches)
    against autograd of :func:`independent_mixed_loss` in float64 at the weights it was taken at.
    Returns the relative errors ||g_worker - g|| / ||g||."""
    gradients = read_gradient_records(audit)
    by_step: dict[int, list[dict]] = defaultdict(list)
    for path in sorted(Path(audit).glob("*.pt")):
        record = torch.load(path)
        by_step[record["replay_optimizer_step"]].append(record)
    errors = []
    for record in gradients:
        step = record["replay_optimizer_step"]
        if steps is not None and step not in steps:
            continue
        model = tiny_model(model_dir, record["weights"], torch.float64)
        loss, _ = independent_mixed_loss(model, by_step[step], mu=mu, elite=elite)
        loss.backward()
        params = dict(model.named_parameters())
        names = sorted(record["grads"])
        expected = torch.cat(  # a parameter the loss does not reach (the vision tower) has no gradient here
            [torch.zeros(params[n].numel()) if params[n].grad is None else params[n].grad.reshape(-1) for n in names]
        ).double()
        got = torch.cat([record["grads"][name].double().reshape(-1) for name in names])
        for name, param in params.items():  # a parameter the worker saw no gradient for has none here
            if name not in record["grads"] and param.grad is not None:
                assert float(param.grad.abs().max()) == 0.0, name
        error = float((got - expected).norm() / expected.norm())
        errors.append(error)
        assert error < rtol, (step, error)
    return errors


def check_ingress_against_rewards(events: list[dict], dump, *, group_size: int) -> int:
    """Ingress against the rewards verl itself dumped for the fresh rows (``trainer.rollout_data_dir``;
    the tiny tasks score 1 for a correct answer, 0 otherwise): per global step, the groups admitted
    are exactly as many as the fresh groups whose answers disagree (0 < correct < n), with the same
    counts of correct answers. Returns the number of admitted groups."""
    import json

    admitted = 0
    for path in sorted(Path(dump).glob("*.jsonl")):
        step = int(path.stem)
        scores: dict[str, list[float]] = defaultdict(list)
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if not row["uid"].startswith(("replay-", "elite-", "pad")):
                scores[row["uid"].rsplit("_", 2)[0]].append(float(row["score"]))
        assert all(len(v) == group_size and set(v) <= {0.0, 1.0} for v in scores.values()), scores
        disagreeing = sorted(int(sum(v)) for v in scores.values() if 0 < sum(v) < group_size)
        ingress = sorted(e["num_correct"] for e in events if e["event"] == "ingress" and e["step"] == step)
        assert ingress == disagreeing, (step, ingress, disagreeing)
        admitted += len(ingress)
    return admitted


def check_replay_metric_values(events: list[dict], metrics: list[dict], dump, *, group_size: int) -> int:
    """Replay metrics by value, from other records: ``replay/score/mean`` is the mean of the scores
    verl dumped for the replayed responses when they were fresh (matched by their text in the step
    they were born); ``replay/age_accepted/{mean,max}`` are the accepted groups' weight versions since
    generation (the version verl stamped on them, from the ingress records). Returns the number of
    steps with replayed rows."""
    import json

    born_scores: dict[tuple, list[float]] = defaultdict(list)
    replayed: dict[int, list[tuple]] = defaultdict(list)
    for path in sorted(Path(dump).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["uid"].startswith("replay-"):
                replayed[int(path.stem)].append((row["input"], row["output"]))
            elif not row["uid"].startswith(("elite-", "pad")):
                born_scores[(row["input"], row["output"])].append(float(row["score"]))
    ingress = {e["group_id"]: e for e in events if e["event"] == "ingress"}
    steps_with_replay = 0
    for m in metrics:
        step = int(m["training/global_step"])
        accepted = [e for e in events if e["event"] == "scan" and e["step"] == step and e["accepted"]]
        ages = [step - 1 - ingress[e["group_id"]]["generated_version"] for e in accepted]  # step starts at v = step - 1
        if not accepted:
            assert "replay/score/mean" not in m and m["replay/age_accepted/max"] == 0
            continue
        steps_with_replay += 1
        assert m["replay/age_accepted/mean"] == _approx(sum(ages) / len(ages)), (step, ages, m)
        assert m["replay/age_accepted/max"] == max(ages), (step, ages, m)
        texts = replayed[step]
        assert len(texts) == group_size * len(accepted)
        scores = []
        for text in texts:
            assert len(set(born_scores[text])) == 1, text  # the response was dumped fresh, with one score
            scores.append(born_scores[text][0])
        assert m["replay/score/mean"] == _approx(sum(scores) / len(scores)), (step, scores)
    return steps_with_replay


# verl's data metrics that replay must leave to the fresh rows (critic/* and response_length/* from
# the fresh rows only, actor/entropy from their old-log-prob forward)
FRESH_ONLY_METRICS = (
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/advantages/min",
    "response_length/mean",
    "prompt_length/mean",
    "actor/entropy",
)


def _fresh_rows_of_step(rows: list[AuditedRow], global_step: int) -> list[tuple]:
    """The global step's fresh rows as its update saw them, every copy (one per PPO epoch), in a
    fixed order: (tokens, old log-probs, advantages)."""
    found = [
        (r.tokens, r.old_log_probs, r.advantage) for r in rows if r.source == FRESH and r.global_step == global_step
    ]
    assert found, f"no fresh rows audited in global step {global_step}"
    return sorted(found, key=lambda item: (item[0], item[2].tolist(), item[1].tolist()))


def check_fresh_rows_untouched(
    on_rows: list[AuditedRow],
    off_rows: list[AuditedRow],
    on_metrics: list[dict],
    off_metrics: list[dict],
    *,
    through_step: int,
) -> int:
    """With replay on, each global step's fresh rows are what the same step gives with replay off
    (same seed, synchronous trainer), through the first step that trained on replayed rows (after
    it the weights differ): the same responses, the same advantages, the same old log-probs (up to
    the float summation order of a different micro-batch split), the same fresh-only metrics.
    Returns the number of replayed rows the compared updates trained on."""
    replayed = 0
    for step in range(1, through_step + 1):
        on, off = _fresh_rows_of_step(on_rows, step), _fresh_rows_of_step(off_rows, step)
        assert [r[0] for r in on] == [r[0] for r in off], f"step {step}: the fresh responses differ"
        for (tokens, on_old, on_adv), (_, off_old, off_adv) in zip(on, off, strict=True):
            torch.testing.assert_close(on_adv, off_adv, rtol=1e-6, atol=1e-6, msg=f"step {step}: advantages")
            torch.testing.assert_close(on_old, off_old, rtol=1e-5, atol=1e-5, msg=f"step {step}: old log-probs")
        m_on, m_off = on_metrics[step - 1], off_metrics[step - 1]
        assert m_on["training/global_step"] == m_off["training/global_step"] == step
        for key in FRESH_ONLY_METRICS:
            assert m_on[key] == _approx(m_off[key]), (step, key, m_on[key], m_off[key])
        replayed += sum(r.source == GROUP_REPLAY and r.global_step == step for r in on_rows)
    return replayed

"""Evaluation through the job's own layout: validation loss, greedy answers, metrics, predictions file.

What one evaluation reports (:class:`EvalReport`, written to ``metrics.jsonl`` by the trainer):

- **validation loss**, teacher-forced, per task and overall: the sum of token cross-entropies divided by the target
  tokens of the whole validation set (per task: of that task's samples), normalised as training's loss. The
  validation records are processed again with their answers (:func:`teacher_forced_sample`; the validation set
  itself holds prompts), so the loss covers exactly the answer tokens training would train.
- **exact match** per task and overall (:func:`plait.models.generation.exact_match` of the greedy answer), and
- **pluggable metrics** (``train.eval_metrics``: ``"module:function"``, :func:`load_metrics`), called with the
  predictions and references of all samples and of each task.
- a **predictions file** per evaluation, ``<run_dir>/predictions/step_<N>.jsonl`` (:func:`write_predictions`): one
  line per validation sample with ``id``, ``task``, ``prompt``, ``prediction``, ``reference``, in dataset order.

Sharing the work (:func:`plan_eval_microbatches`): the validation samples are ordered by (task, index) and
strided over the DP replicas, then cut into microbatches of one task each (``train.eval_batch_size``), so each
microbatch's loss sum belongs to one task; every rank of a replica (its CP ranks, its pipeline ranks) runs the
same microbatches. The non-pipeline trainer runs them through its model (DP x CP), the pipeline trainer through
its stages with a forward-only schedule (``plait.parallel.pipeline.run_pipeline_forward``). Loss sums and target
counts are summed over the job once (:class:`LossTable`); predictions are gathered on rank 0, which scores them,
writes the file and broadcasts the report.

Greedy decoding in a pipeline (:func:`greedy_by_forward`): no rank holds the whole model, so there is no KV cache
across stages; each new token is one forward-only pipeline pass over the whole prompt plus the tokens so far,
microbatched (``EvalSide.group`` microbatches in flight per pass), the last stage taking the argmax at the last
position (:func:`next_token_ids`) and the ranks of the replica agreeing on it by one all-reduce. Memory: one
forward's activations per stage, as training's forward without autograd. Cost: for ``T`` new tokens and prompts of
``N`` tokens, ``T`` passes over ``N..N+T`` tokens, about ``T (N + T/2)`` token-forwards per sample instead of
``N + T`` with a KV cache (encoders re-run each pass too), which for validation answers of a few tokens is a few times a
teacher-forced pass. It stops as :func:`plait.models.generation.greedy_token_ids` does (a row ends with its first
stop token, then pads; all rows ended or ``max_new_tokens``), so the answers are the same greedy answers.
"""

from __future__ import annotations

import importlib
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.data.collate import Batch, collate
from plait.data.processing import IGNORE, ProcessedSample
from plait.data.progress import Progress
from plait.data.sources import RawSample, sample_at
from plait.models.generation import check_decoding, exact_match, is_empty_answer

__all__ = [
    "EvalReport",
    "EvalSide",
    "LossTable",
    "Prediction",
    "eval_batch_size",
    "evaluate_on",
    "extend_batch",
    "finish",
    "gather_predictions",
    "greedy_by_forward",
    "load_metrics",
    "next_token_ids",
    "plan_eval_microbatches",
    "predictions_of",
    "prompt_text",
    "raw_record",
    "score",
    "teacher_forced_sample",
    "with_last_marked",
    "write_predictions",
]

MetricFn = Callable[[list[str], list[str]], Any]


# ------------------------------------------------------------------ who evaluates what
def plan_eval_microbatches(tasks: Sequence[str], dp: int, dp_rank: int, size: int) -> list[list[int]]:
    """DP replica ``dp_rank``'s validation microbatches (dataset indices): the samples ordered by (task, index),
    strided over ``dp`` replicas (each replica gets about its share of every task), cut into microbatches of at
    most ``size`` samples of one task each, in (task, index) order.

    Args:
        tasks: the task of every validation sample, by dataset index.

    Raises:
        ValueError: when ``dp`` < 1, ``dp_rank`` is not in ``[0, dp)`` or ``size`` < 1.
    """
    if dp < 1 or not 0 <= dp_rank < dp or size < 1:
        raise ValueError(f"plan_eval_microbatches: need dp >= 1, 0 <= dp_rank < dp and size >= 1, got dp={dp}, "
                         f"dp_rank={dp_rank}, size={size}")
    mine = sorted(range(len(tasks)), key=lambda i: (tasks[i], i))[dp_rank::dp]
    out: list[list[int]] = []
    for _, group in itertools.groupby(mine, key=lambda i: tasks[i]):
        run = list(group)
        out += [run[k : k + size] for k in range(0, len(run), size)]
    return out


def eval_batch_size(train_cfg: Any) -> int:
    """Validation samples per forward pass: ``train.eval_batch_size``, or ``max(train.microbatch_size, 16)``.

    Raises:
        ValueError: when ``train.eval_batch_size`` is negative.
    """
    if train_cfg.eval_batch_size < 0:
        raise ValueError(f"train.eval_batch_size must be >= 0 (0: max(train.microbatch_size, 16)), got "
                         f"{train_cfg.eval_batch_size}")
    return train_cfg.eval_batch_size or max(train_cfg.microbatch_size, 16)


def raw_record(val_set: Any, index: int) -> RawSample:
    """The validation record of dataset sample ``index`` (read again from its source)."""
    return sample_at(val_set.source, int(val_set.table.rows[index]))


def teacher_forced_sample(val_set: Any, index: int) -> ProcessedSample:
    """Validation sample ``index`` processed with its answer (ids and labels as training processes a record), for
    the teacher-forced validation loss; the validation set itself holds prompts only.

    Raises:
        SampleError: naming the record, when the processor refuses it with its answer (e.g. too long).
    """
    return val_set.processor(raw_record(val_set, index))


def prompt_text(raw: RawSample) -> str:
    """The prompt of a record for the predictions file: its last message before the answer (the user's turn)."""
    return raw.messages[-2]["content"] if len(raw.messages) > 1 else ""


# ------------------------------------------------------------------ validation loss
class LossTable:
    """Per task, the validation loss sum (token cross-entropies) and target tokens; summed over the job once.

    A rank adds the loss sums it computed (in a pipeline: the last stage; with CP: its tokens' part) and, where it
    is the one rank of its replica that counts them, the target tokens of its samples, so the job-wide sum counts
    every token once.
    """

    def __init__(self, tasks: Sequence[str]) -> None:
        self.tasks = sorted(set(tasks))
        self._row = {t: i for i, t in enumerate(self.tasks)}
        self.table = torch.zeros(len(self.tasks), 2, dtype=torch.float64)

    def add(self, task: str, loss_sum: float | torch.Tensor = 0.0, targets: int = 0) -> None:
        """Add a microbatch of ``task``: its loss sum and (when this rank counts them) its target tokens."""
        self.table[self._row[task], 0] += float(loss_sum)
        self.table[self._row[task], 1] += targets

    def all_reduce(self, device: torch.device) -> None:
        """Sum the table over every rank of the job (collective; nothing without a process group)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            summed = self.table.to(device)
            dist.all_reduce(summed)
            self.table = summed.cpu()

    def losses(self) -> tuple[dict[str, float], float]:
        """``(loss per task, overall loss)``: loss sums / target tokens (0.0 where there is no target)."""
        per = {t: float(s / n) if n else 0.0 for t, (s, n) in zip(self.tasks, self.table.tolist())}
        total, targets = self.table.sum(0).tolist()
        return per, float(total / targets) if targets else 0.0


# ------------------------------------------------------------------ greedy decoding through forward passes
def with_last_marked(batch: Batch) -> Batch:
    """``batch`` (left-padded prompts) with labels that mark only the last position (label 0, -100 elsewhere):
    :func:`next_token_ids` reads the logits there. The labels travel with the batch through the stages and are
    sharded with the tokens under CP, so the CP rank holding the last token is the one that sees the mark."""
    labels = torch.full_like(batch.labels, IGNORE)
    labels[:, -1] = 0
    return replace(batch, labels=labels)


def next_token_ids(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The argmax token ``[B]`` (int64) at the position each row's ``labels`` mark (:func:`with_last_marked`), -1
    for a row whose mark is not among these tokens (another CP rank holds it). ``logits``: ``[B, N, V]``."""
    marked = labels != IGNORE
    best = logits.argmax(-1)
    out = torch.full((logits.shape[0],), -1, dtype=torch.long, device=logits.device)
    rows, cols = marked.nonzero(as_tuple=True)
    out[rows] = best[rows, cols]
    return out


def extend_batch(batch: Batch, tokens: torch.Tensor) -> Batch:
    """A left-padded prompt batch with one more token ``tokens`` ``[B]`` at the end of every row (attention 1,
    next position, text), the labels marking it (:func:`with_last_marked`)."""
    def cat(x: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, col.to(x.dtype).to(x.device).unsqueeze(1)], dim=1)

    ones = torch.ones_like(tokens)
    grown = replace(batch, input_ids=cat(batch.input_ids, tokens), labels=cat(batch.labels, ones),
                    attention_mask=cat(batch.attention_mask, ones),
                    position_ids=cat(batch.position_ids, batch.position_ids[:, -1] + 1),
                    document_ids=cat(batch.document_ids, ones * 0), item_ids=cat(batch.item_ids, -ones))
    return with_last_marked(grown)


def greedy_by_forward(forward: Callable[[list[Batch]], list[torch.Tensor]], batches: Sequence[Batch],
                      stop_ids: Sequence[int], max_new_tokens: int, pad_id: int) -> list[torch.Tensor]:
    """Greedy decoding by repeated forward passes without a KV cache (module docstring): per batch of left-padded
    prompts, the new tokens ``[B, T]`` with the stopping rule of
    :func:`plait.models.generation.greedy_token_ids` (a row keeps its first stop token and is ``pad_id`` after it;
    decoding ends when every row of every batch has ended or after ``max_new_tokens``).

    Args:
        forward: one pass over all batches (labels marking the last position), returning per batch the next
            token ``[B]`` of every row, the same on every rank that calls it (e.g. a pipeline pass followed by
            an all-reduce).
        batches: left-padded prompt batches.

    Raises:
        ValueError: when ``max_new_tokens`` < 1 or there is no stop token.
    """
    check_decoding(max_new_tokens, stop_ids)
    current = [with_last_marked(b) for b in batches]
    stops = torch.tensor(list(stop_ids), dtype=torch.long)
    done = [torch.zeros(b.input_ids.shape[0], dtype=torch.bool) for b in batches]
    new: list[list[torch.Tensor]] = [[] for _ in batches]
    for _ in range(max_new_tokens):
        nexts = forward(current)
        for k, tokens in enumerate(nexts):
            tokens = tokens.cpu().long()
            tokens = torch.where(done[k], torch.full_like(tokens, pad_id), tokens)
            new[k].append(tokens)
            done[k] |= torch.isin(tokens, stops)
            current[k] = extend_batch(current[k], tokens)
        if all(bool(d.all()) for d in done):
            break
    return [torch.stack(cols, dim=1) for cols in new]


# ------------------------------------------------------------------ scoring and reporting
@dataclass(frozen=True)
class Prediction:
    """One validation sample's greedy answer: record ``id``, ``task``, ``prompt`` (the user's turn), ``prediction``
    and ``reference`` (the record's answer); ``index`` is its dataset index (file order)."""

    index: int
    id: str
    task: str
    prompt: str
    prediction: str
    reference: str

    def to_json(self) -> str:
        """One line of the predictions file (``index`` left out; ``"empty": true`` on an empty answer,
        :func:`~plait.models.generation.is_empty_answer`, as ``plait generate`` writes it)."""
        return json.dumps({"id": self.id, "task": self.task, "prompt": self.prompt, "prediction": self.prediction,
                           "reference": self.reference} | ({"empty": True} if is_empty_answer(self.prediction) else {}),
                          ensure_ascii=False)


def load_metrics(paths: Sequence[str]) -> dict[str, MetricFn]:
    """The functions of ``train.eval_metrics`` (``"package.module:function"``), by function name.

    Raises:
        ValueError: naming ``train.eval_metrics[i]`` for a path without ``:``, a module that does not import, a
            missing or non-callable attribute, or two metrics of the same name.
    """
    out: dict[str, MetricFn] = {}
    for i, path in enumerate(paths):
        where = f"train.eval_metrics[{i}] = {path!r}"
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise ValueError(f"{where}: expected 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{where}: cannot import {module_name!r} ({exc})") from exc
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"{where}: {module_name} has no function {attr!r}")
        if attr in out:
            raise ValueError(f"{where}: a metric named {attr!r} is already listed")
        out[attr] = fn
    return out


def _metric_values(name: str, fn: MetricFn, preds: list[str], refs: list[str]) -> dict[str, float]:
    try:
        value = fn(preds, refs)
    except Exception as exc:  # a user's function: any error, named as the metric's
        raise ValueError(f"train.eval_metrics: {name}(predictions, references) raised {type(exc).__name__}: {exc} "
                         "(a metric takes two lists of strings and returns a float or a dict of floats)") from exc
    if isinstance(value, Mapping):
        return {str(k): float(v) for k, v in value.items()}
    try:
        return {name: float(value)}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"train.eval_metrics: {name} returned {value!r}, not a float or a dict of floats") from exc


@dataclass(frozen=True)
class EvalReport:
    """One evaluation (module docstring).

    Attributes:
        step: the optimizer step evaluated.
        exact_match: per task, the fraction of answers equal to the reference (what ``fit`` reports as ``eval``).
        exact_match_overall: over all validation samples.
        loss: per task, the teacher-forced validation loss (token cross-entropy per target token).
        loss_overall: over the whole validation set.
        metrics: ``train.eval_metrics`` values: ``<name>`` over all samples, ``<name>/<task>`` per task.
        predictions_path: the predictions file (None when nothing was written: no validation sample).
        samples: validation samples evaluated.
    """

    step: int
    exact_match: dict[str, float]
    exact_match_overall: float
    loss: dict[str, float]
    loss_overall: float
    metrics: dict[str, float] = field(default_factory=dict)
    predictions_path: str | None = None
    samples: int = 0

    def record(self) -> dict[str, Any]:
        """What goes to ``metrics.jsonl`` besides ``{"step", "eval": exact_match}``: ``val_loss``,
        ``val_loss_per_task``, ``exact_match`` (overall), ``val_metrics`` and ``predictions`` (the file)."""
        return {"val_loss": self.loss_overall, "val_loss_per_task": self.loss, "exact_match": self.exact_match_overall,
                "val_metrics": self.metrics, "predictions": self.predictions_path}


def score(step: int, predictions: Sequence[Prediction], losses: LossTable, metrics: Mapping[str, MetricFn],
          predictions_path: str | None = None) -> EvalReport:
    """The report of one evaluation from every sample's prediction and the job-wide loss table: exact match and
    each metric over all samples and per task (every task of ``losses``, 0.0 for a task without a sample)."""
    by_task: dict[str, list[Prediction]] = {t: [] for t in losses.tasks}
    for p in predictions:
        by_task.setdefault(p.task, []).append(p)
    em = {t: sum(exact_match(p.prediction, p.reference) for p in ps) / len(ps) if ps else 0.0
          for t, ps in sorted(by_task.items())}
    overall = sum(exact_match(p.prediction, p.reference) for p in predictions) / max(1, len(predictions))
    values: dict[str, float] = {}
    for name, fn in metrics.items():
        if predictions:
            values.update(_metric_values(name, fn, [p.prediction for p in predictions],
                                         [p.reference for p in predictions]))
        for task, ps in sorted(by_task.items()):
            if ps:
                got = _metric_values(name, fn, [p.prediction for p in ps], [p.reference for p in ps])
                values.update({f"{k}/{task}": v for k, v in got.items()})
    per_loss, loss = losses.losses()
    return EvalReport(step, em, overall, per_loss, loss, values, predictions_path, len(predictions))


def write_predictions(run_dir: str | Path, step: int, predictions: Sequence[Prediction]) -> Path:
    """Write ``<run_dir>/predictions/step_<step>.jsonl`` (one JSON line per sample, dataset order); returns it."""
    path = Path(run_dir) / "predictions" / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [p.to_json() for p in sorted(predictions, key=lambda p: p.index)]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def gather_predictions(mine: Sequence[Prediction]) -> list[Prediction] | None:
    """Every rank's predictions on rank 0, in dataset order (None elsewhere). Collective when distributed."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return sorted(mine, key=lambda p: p.index)
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(list(mine), parts, dst=0)
    if parts is None:
        return None
    return sorted((p for part in parts for p in part), key=lambda p: p.index)


def finish(step: int, mine: Sequence[Prediction], losses: LossTable, metrics: Mapping[str, MetricFn],
           run_dir: str | Path, device: torch.device) -> EvalReport:
    """Sum the loss table over the job, gather the predictions on rank 0, which scores them and writes the
    predictions file, and give every rank the same :class:`EvalReport` (collective when distributed)."""
    losses.all_reduce(device)
    gathered = gather_predictions(mine)
    report: list[Any] = [None]
    if gathered is not None:
        path = write_predictions(run_dir, step, gathered) if gathered else None
        report[0] = score(step, gathered, losses, metrics, str(path) if path else None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(report, src=0)
    return report[0]


def predictions_of(val_set: Any, indices: Sequence[int], answers: Sequence[str]) -> list[Prediction]:
    """:class:`Prediction` objects of validation samples ``indices`` answered ``answers`` (records read again for
    their id, task, prompt and reference)."""
    out = []
    for i, answer in zip(indices, answers):
        raw = raw_record(val_set, i)
        out.append(Prediction(int(i), raw.id, raw.task, prompt_text(raw), answer, raw.messages[-1]["content"]))
    return out


@dataclass(frozen=True)
class EvalSide:
    """How one rank takes part in an evaluation (the trainer says; :func:`evaluate_on` runs it).

    Attributes:
        loss_share, answer_share: ``(replicas, this rank's replica)`` over which the validation samples are shared
            for the loss and for the answers (:func:`plan_eval_microbatches`).
        counts_targets: this rank counts its loss microbatches' target tokens (one rank per replica).
        records: this rank keeps its answers as predictions (one rank per answer replica).
        group: microbatches per call of ``loss_of`` / ``answers_of`` (a pipeline's microbatches in flight).
        loss_of: teacher-forced batches -> per batch the loss sum this rank holds (``[]`` when it holds none).
        answers_of: left-padded prompt batches -> per batch the greedy answers (text per row).
    """

    loss_share: tuple[int, int]
    answer_share: tuple[int, int]
    counts_targets: bool
    records: bool
    group: int
    loss_of: Callable[[list[Batch]], list[torch.Tensor]]
    answers_of: Callable[[list[Batch]], list[list[str]]]


def _groups(items: list[list[int]], size: int) -> list[list[list[int]]]:
    return [items[k : k + size] for k in range(0, len(items), max(1, size))]


def evaluate_on(val_set: Any, side: EvalSide, pad_id: int, device: torch.device, size: int, step: int,
                metrics: Mapping[str, MetricFn], run_dir: str | Path, progress: bool = False) -> EvalReport:
    """One evaluation (module docstring) from this rank's side: the validation loss of its loss share, the answers
    of its answer share, then :func:`finish` (collective). Batches are collated unpacked on ``device`` (prompts
    left-padded); ``size``: samples per microbatch; ``progress``: this rank's samples on stderr (rank 0), one
    count for the loss pass and one for the answers."""
    tasks = [val_set.sample_meta(i).task for i in range(len(val_set))]
    losses = LossTable(tasks)
    loss_mbs = plan_eval_microbatches(tasks, *side.loss_share, size)
    answer_mbs = plan_eval_microbatches(tasks, *side.answer_share, size)
    bar = Progress(sum(map(len, loss_mbs)), f"validation step {step}: loss", "sample", progress, leave=False)
    for chunk in _groups(loss_mbs, side.group):
        batches = [collate([teacher_forced_sample(val_set, i) for i in mb], pad_id).to(device) for mb in chunk]
        sums = side.loss_of(batches)
        for k, mb in enumerate(chunk):
            losses.add(tasks[mb[0]], sums[k] if sums else 0.0, batches[k].target_tokens if side.counts_targets else 0)
        bar.update(sum(map(len, chunk)))
    bar.close()
    mine: list[Prediction] = []
    bar = Progress(sum(map(len, answer_mbs)), f"validation step {step}: answers", "sample", progress, leave=False)
    for chunk in _groups(answer_mbs, side.group):
        batches = [collate([val_set[i] for i in mb], pad_id, padding_side="left").to(device) for mb in chunk]
        for mb, answers in zip(chunk, side.answers_of(batches)):
            if side.records:
                mine += predictions_of(val_set, mb, answers)
        bar.update(sum(map(len, chunk)))
    bar.close()
    return finish(step, mine, losses, metrics, run_dir, device)

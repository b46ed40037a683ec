"""``plait generate``: answer prompts with a trained model (``<run_dir>/final``), greedily, as validation does.

One prompt: ``plait generate --model runs/demo/final --image x.png --prompt "Which digit is this?"`` prints the
answer; ``--video clip.mp4`` gives a video to a model whose image branch takes videos, its frames sampled and
processed as in training (the branch's saved ``[model.encoders.<name>.video]`` settings, through
:class:`~plait.data.processing.MultimodalProcessor` and :mod:`plait.data.video`). A batch: ``plait generate --model runs/demo/final --input data.jsonl --output predictions.jsonl`` answers
every record of a JSONL file in plait's data format (:mod:`plait.data.sources`; the last message may be the
user's, or an assistant answer, which becomes the reference and is not shown to the model) and writes one line
per record: ``id``, ``task``, ``prompt`` (the last user message), ``prediction``, ``"empty": true`` when the
answer is empty (:func:`~plait.models.generation.is_empty_answer`: no text, only whitespace before the stop token) and, when
the record has an answer, ``reference``; it then prints how many answers are empty and the exact match per task and
overall. Decoding is
:func:`plait.models.generation.greedy_generate`, the one that training's validation runs.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.data.formats import open_source
from plait.data.progress import Progress
from plait.data.sources import RawSample, SampleError, parse_record
from plait.models.device import apply_cpu_threads
from plait.models.generation import Generator, exact_match, is_empty_answer

__all__ = ["generate_command", "check_output_path", "prompt_sample", "read_prompts", "exact_match_report", "prediction_row",
           "empty_report", "EMPTY_ANSWER", "EMPTY_WHY"]

EMPTY_ANSWER = "(empty answer: the model generated no text, nothing but whitespace before its stop token)"
"""What ``plait generate --prompt`` prints on stderr after an empty answer (stdout keeps the answer itself)."""
EMPTY_WHY = "no text, nothing but whitespace before the stop token"
"""Why an answer counts as empty (:func:`~plait.models.generation.is_empty_answer`), in the ``--output`` summary."""


def generate_command(model: str | Path, *, prompt: str | None = None, images: Sequence[str] = (),
                     audios: Sequence[str] = (), videos: Sequence[str] = (), input_path: str | Path | None = None,
                     output_path: str | Path | None = None, max_new_tokens: int = 16, batch_size: int = 16,
                     device: str = "auto", dtype: str = "auto", threads: int | None = None) -> int:
    """``plait generate``: with ``prompt`` print the answer to it (with ``images``/``audios``); with
    ``input_path`` answer every record of that data file into ``output_path`` (module docstring); ``videos`` go with
    ``prompt`` (:meth:`Generator.ask`, refused for a model that takes none); ``device`` and
    ``dtype`` as :class:`~plait.models.generation.Generator`; ``threads``: torch's intra-op CPU threads
    (``torch.set_num_threads``, as training's ``train.threads``), None chooses them from this host's free cores
    (:func:`plait.models.device.choose_cpu_threads`). Returns 0.

    An empty answer (:func:`~plait.models.generation.is_empty_answer`) is printed as it is, followed by
    :data:`EMPTY_ANSWER` on stderr; in ``output_path`` its line has ``"empty": true`` (:func:`prediction_row`) and
    the summary counts them (:func:`empty_report`).

    Raises:
        ValueError: for a bad combination of arguments, an empty ``prompt`` without media, an ``output_path`` that is
            the input file or a directory (:func:`check_output_path`, before any generation), a bad record (naming
            file, line and record), and as
            :meth:`Generator.from_pretrained`.
        SampleError: for a video that cannot be decoded, gives more frames than the model's ``max_frames`` (naming
            the file and the field), or goes to a model that takes no video.
        FileNotFoundError: for a missing model folder, input file or media file (naming it).
    """
    if (prompt is None) == (input_path is None):
        raise ValueError("give either --prompt (one answer, printed) or --input with --output (a JSONL file)")
    if input_path is not None and (images or audios or videos):
        raise ValueError("--image/--audio/--video go with --prompt; with --input the records name their media")
    if input_path is not None and output_path is None:
        raise ValueError("--input needs --output: the JSONL file to write the predictions to")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"--max-new-tokens and --batch-size must be >= 1, got {max_new_tokens} and {batch_size}")
    if threads is not None and threads < 0:
        raise ValueError(f"--threads must be >= 0 (0: chosen from this host's free cores), got {threads}")
    if prompt is not None and not prompt.strip() and not (images or audios or videos):
        raise ValueError("--prompt is empty and no --image/--audio/--video is given: there is nothing to answer")
    if output_path is not None:
        check_output_path(Path(output_path), Path(input_path))  # type: ignore[arg-type]
    apply_cpu_threads(threads or 0, "--threads")
    gen = Generator.from_pretrained(model, device=device, dtype=dtype)
    if prompt is not None:
        if videos:
            _check_takes_video(gen)
        answer = gen.ask(prompt, images, audios, max_new_tokens=max_new_tokens, videos=videos)
        print(answer, flush=True)
        if is_empty_answer(answer):
            print(EMPTY_ANSWER, file=sys.stderr, flush=True)
        return 0
    _answer_file(gen, Path(input_path), Path(output_path), max_new_tokens, batch_size)  # type: ignore[arg-type]
    return 0


def check_output_path(output_path: Path, input_path: Path) -> None:
    """Refuse an ``--output`` that would destroy data or fail only after every prompt is answered: one that resolves
    to the ``--input`` file (same path after ``..`` and links are resolved, or the same file by inode), or an
    existing directory. An existing other file is overwritten, as any output file.

    Raises:
        ValueError: naming both paths, or the directory.
    """
    if output_path.is_dir():
        raise ValueError(f"--output {output_path} is a directory: give the JSONL file to write the predictions to, "
                         f"e.g. --output {output_path / 'predictions.jsonl'}")
    same = output_path.resolve() == input_path.resolve()
    if not same and output_path.exists() and input_path.exists():
        same = output_path.samefile(input_path)
    if same:
        raise ValueError(f"--output {output_path} is the --input file {input_path}: writing the predictions there "
                         "would overwrite the records; give another --output file")


def prompt_sample(gen: Generator, text: str, images: Sequence[str] = (), audios: Sequence[str] = (),
                  videos: Sequence[str] = ()) -> RawSample:
    """The one-turn prompt ``text`` with its media as the raw sample ``plait generate --prompt`` answers
    (:meth:`Generator.prompt`: a placeholder per item put before ``text`` when it holds none, each item as the
    checkpoint's records write it: ``<|vision_start|><|image_pad|><|vision_end|>`` for an imported Qwen2.5-VL,
    ``<|audio_bos|><|AUDIO|><|audio_eos|>`` for Qwen2-Audio, else the bare placeholder). The videos are decoded,
    sampled and processed when the sample is processed, by the same code as training's records.

    Raises:
        SampleError: when ``videos`` go to a model that takes none (:func:`_check_takes_video`).
    """
    if videos:
        _check_takes_video(gen)
    return gen.prompt(text, images, audios, videos).raw()


def _check_takes_video(gen: Generator) -> None:
    """Refuse ``--video`` for a model that takes none, saying why and what to do (the data layer's message names the
    training field instead).

    Raises:
        SampleError: when the model has no image branch, or its video placeholder is not a token of its tokenizer.
    """
    image = gen.processor.specs.get("image")
    if image is None:
        raise SampleError("this model takes no video: it has no image encoder to encode the frames")
    if image.video is None or image.video.placeholder_id is None:
        name = image.encoder
        raise SampleError(f"this model takes no video (its job had no [model.encoders.{name}.video] placeholder that is "
                          "a token of its tokenizer): give the frames as --image files, or train it on video records "
                          f"with [model.encoders.{name}.video] placeholder = a token of the tokenizer")


def _answer_file(gen: Generator, input_path: Path, out: Path, max_new_tokens: int, batch_size: int) -> None:
    """Answer every record of ``input_path`` into ``out`` (progress on stderr), then print the
    exact-match lines."""
    raws, records = read_prompts(input_path)
    progress = Progress(len(raws), "generate", "prompt")
    try:
        predictions = gen.generate_raw(raws, max_new_tokens, batch_size, progress=progress.update)
    finally:
        progress.close()
    rows = [prediction_row(rec, p) for rec, p in zip(records, predictions)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"plait: {len(rows)} predictions written to {out}", flush=True)
    for line in [empty_report(rows), *exact_match_report(rows)]:
        print(line, flush=True)


def read_prompts(path: str | Path) -> tuple[list[RawSample], list[dict[str, Any]]]:
    """The records of a data file in plait's data format (any format :func:`plait.data.formats.open_source`
    reads: JSONL, LLaVA JSON, Parquet/Arrow) as raw samples, and per record its output fields without the
    prediction (``id``, ``task``, ``prompt``: the last user message, ``reference`` when the record ends with an
    assistant answer; a record that ends with the user's turn gets an empty answer, which generation leaves out).
    Media paths are relative to the file's folder; media are read when their batch runs.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        SampleError: for the first bad record (naming file, line and record), or a file without records.
    """
    source = open_source(path)
    raws, records = [], []
    for i in range(len(source)):
        obj, where, error = source[i]
        if error is not None:
            raise SampleError(f"{where}: {error}")
        messages = obj.get("messages")
        answered = isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict) \
            and messages[-1].get("role") == "assistant"
        if isinstance(messages, list) and messages and not answered:
            obj = obj | {"messages": messages + [{"role": "assistant", "content": ""}]}
        raw = parse_record(obj, where, source.base_dir)
        raws.append(raw)
        user = [m["content"] for m in raw.messages[:-1] if m["role"] == "user"]
        rec = {"id": raw.id, "task": raw.task, "prompt": user[-1] if user else ""}
        records.append(rec | ({"reference": raw.messages[-1]["content"]} if answered else {}))
    if not raws:
        raise SampleError(f"{path} holds no record")
    return raws, records


def prediction_row(record: dict[str, Any], prediction: str) -> dict[str, Any]:
    """One line of ``--output``: the record's fields (:func:`read_prompts`) with its ``prediction``, and
    ``"empty": true`` when the prediction is empty (:func:`~plait.models.generation.is_empty_answer`; the field is
    absent otherwise)."""
    return record | {"prediction": prediction} | ({"empty": True} if is_empty_answer(prediction) else {})


def empty_report(rows: Sequence[dict[str, Any]]) -> str:
    """The summary line counting the rows marked ``"empty"`` (:func:`prediction_row`), e.g.
    ``plait: 2 of 16 answers empty (no text, nothing but whitespace before the stop token; "empty": true in their
    lines)``."""
    empty = sum(1 for r in rows if r.get("empty"))
    return (f"plait: {empty} of {len(rows)} answers empty ({EMPTY_WHY}; "
            '"empty": true in their lines)')


def exact_match_report(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Lines giving the exact match (:func:`plait.models.generation.exact_match`) of the rows that have a
    ``reference``, per task (sorted) and overall; no line when none has one."""
    scored = [r for r in rows if "reference" in r]
    if not scored:
        return []
    total, right = Counter(r["task"] for r in scored), Counter()
    for r in scored:
        right[r["task"]] += exact_match(r["prediction"], r["reference"])
    lines = [f"plait: exact match {t}: {right[t] / total[t]:.1%} ({right[t]}/{total[t]})" for t in sorted(total)]
    n, c = len(scored), sum(right.values())
    return lines + [f"plait: exact match: {c / n:.1%} ({c}/{n})"]

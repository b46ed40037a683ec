"""Deterministic builder of the plait demo dataset (images, spoken digits, chat records, tokenizer).

Run ``python -m plait.data.demo.build --out data/demo [--seed 0]``. The output folder gets:

- ``img/NNNNNN.png``: scikit-learn ``load_digits`` images (8x8, 17 grey levels 0..16, UCI
  "Optical Recognition of Handwritten Digits", CC BY 4.0), file name = sklearn index, saved as
  RGB PNG after a bilinear upscale to 16x16, 24x24 or 32x32 pixels (one size per image, drawn from
  the seed). Ink is bright on a black background, as in the source.
- ``aud/NNNNNN.flac``: 1 to 3 spoken digits synthesised with espeak-ng (several voices and speeds),
  resampled to 16 kHz mono, leading/trailing silence trimmed, peak-normalised to 0.9 and stored as
  8-bit FLAC (lossless container, 8-bit samples) so that the whole folder stays below 15 MB.
- ``train.jsonl`` / ``val.jsonl``: conversation records (tasks ``image_digit``, ``audio_transcribe``,
  ``image_audio``, ``text``); media paths are relative to the jsonl folder. Train and validation
  share no source image and no audio file.
- ``tokenizer/``: a byte-level BPE (vocabulary 512) trained on the demo text, saved as a
  transformers fast tokenizer with a ChatML chat template whose assistant turns are marked with
  ``{% generation %}`` so ``return_assistant_tokens_mask=True`` works.
- ``build_info.json`` and ``README.md``: versions, seed, counts and sizes.
- ``match_train.jsonl`` / ``match_val.jsonl``: the fine-tuning task ``digit_pair`` built from the above
  (:mod:`plait.data.demo.match`).

Requires espeak-ng on PATH and the Python packages scikit-learn, scipy, soundfile, Pillow, numpy,
tokenizers and transformers (imported lazily, so this module imports without them).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from plait.data.chat_template import read_chat_template
from plait.data.demo.match import build_match_task

__all__ = [
    "AUDIO_SAMPLE_RATE",
    "CHAT_TEMPLATE",
    "DIGIT_WORDS",
    "IMAGE_SIZES",
    "MAX_CLIP_SECONDS",
    "SPECIAL_TOKENS",
    "BuildConfig",
    "Utterance",
    "build_demo",
    "build_tokenizer",
    "main",
    "plan_task_counts",
    "plan_utterances",
    "require_espeak",
    "synthesize",
    "trim_silence",
]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
IMAGE_SIZES = (16, 24, 32)
AUDIO_SAMPLE_RATE = 16_000
MAX_CLIP_SECONDS = 2.5
ESPEAK_SAMPLE_RATE = 22_050
VOICES = ("en", "en-us", "en+f2", "en+f3", "en+m3", "en-us+f4", "en-gb-scotland", "en-029+m5")
SPEEDS_WPM = (140, 150, 160, 170, 180, 190, 200)
DIGIT_COUNT_WEIGHTS = {1: 0.2, 2: 0.4, 3: 0.4}
TASK_SHARES = {"image_digit": 0.40, "audio_transcribe": 0.40, "image_audio": 0.15, "text": 0.05}

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IMAGE_TOKEN, AUDIO_TOKEN = "<image>", "<audio>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END, IMAGE_TOKEN, AUDIO_TOKEN)
TOKENIZER_VOCAB_SIZE = 512

# ChatML, the committed template: string or typed message contents; the assistant content and its closing
# <|im_end|> are the generation (trained) span.
CHAT_TEMPLATE = read_chat_template("chatml")

PROMPTS = {
    "image_digit": (
        "<image>\nWhich digit is this?",
        "<image>\nWhat digit is shown in the image?",
        "Name the handwritten digit.\n<image>",
    ),
    "audio_transcribe": (
        "<audio>\nTranscribe the audio.",
        "<audio>\nWhich digits are spoken?",
        "Write down the spoken digits.\n<audio>",
    ),
    "image_audio": (
        "<image>\n<audio>\nName the digit in the image, then transcribe the audio.",
        "<image>\n<audio>\nWhich digit is shown, and which digits are spoken?",
    ),
}


@dataclass(frozen=True)
class BuildConfig:
    """Sizes and seed of one demo build (record and file counts, not bytes).

    ``train_utterances`` / ``val_utterances`` are the numbers of distinct audio files per split;
    validation images are ``val`` image_digit + image_audio records, all other sklearn images train.
    """

    seed: int = 0
    train_records: int = 3000
    val_records: int = 400
    train_utterances: int = 1500
    val_utterances: int = 220


@dataclass(frozen=True)
class Utterance:
    """One planned spoken-digit clip: digits (e.g. ``(3, 1, 4)``), espeak voice and speed (words/min)."""

    digits: tuple[int, ...]
    voice: str
    wpm: int

    @property
    def words(self) -> str:
        """Transcript, digit words joined by single spaces ("three one four")."""
        return " ".join(DIGIT_WORDS[d] for d in self.digits)


@dataclass
class _Stream:
    """Draws items of one split pool: a shuffled pass without repeats, then further reshuffled passes."""

    items: list[Any]
    rng: np.random.Generator
    _order: list[Any] = field(default_factory=list)

    def draw(self) -> Any:
        if not self.items:
            raise ValueError("cannot draw from an empty pool; increase the pool size")
        if not self._order:
            self._order = [self.items[i] for i in self.rng.permutation(len(self.items))]
        return self._order.pop()


# ----------------------------------------------------------------------------------------------
# planning (pure)


def plan_task_counts(n_records: int) -> dict[str, int]:
    """Split ``n_records`` into task counts with shares 40/40/15/5 % (largest remainder rounding).

    Raises ValueError if ``n_records`` is negative.
    """
    if n_records < 0:
        raise ValueError(f"n_records must be >= 0, got {n_records}")
    raw = {t: s * n_records for t, s in TASK_SHARES.items()}
    counts = {t: int(np.floor(v)) for t, v in raw.items()}
    by_remainder = sorted(raw, key=lambda t: (counts[t] - raw[t], list(raw).index(t)))
    for t in by_remainder[: n_records - sum(counts.values())]:
        counts[t] += 1
    return counts


def plan_utterances(n: int, rng: np.random.Generator) -> list[Utterance]:
    """Plan ``n`` distinct (digits, voice, speed) clips; 20/40/40 % have 1/2/3 digits.

    Raises ValueError if ``n`` exceeds the number of distinct combinations.
    """
    lengths, weights = zip(*DIGIT_COUNT_WEIGHTS.items())
    capacity = sum(10**k for k in lengths) * len(VOICES) * len(SPEEDS_WPM)
    if not 0 <= n <= capacity // 2:
        raise ValueError(f"utterance count must be in [0, {capacity // 2}], got {n}")
    seen: set[Utterance] = set()
    out: list[Utterance] = []
    while len(out) < n:
        k = int(rng.choice(lengths, p=np.asarray(weights) / sum(weights)))
        u = Utterance(
            digits=tuple(int(d) for d in rng.integers(0, 10, size=k)),
            voice=str(VOICES[rng.integers(len(VOICES))]),
            wpm=int(SPEEDS_WPM[rng.integers(len(SPEEDS_WPM))]),
        )
        if u not in seen:
            seen.add(u)
            out.append(u)
    return out


def _split_images(labels: np.ndarray, n_val: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Disjoint (train, val) sklearn indices; val takes every class in turn (balanced digits)."""
    if not 0 < n_val < len(labels):
        raise ValueError(f"validation image count must be in (0, {len(labels)}), got {n_val}")
    per_class = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(10)]
    val: list[int] = []
    while len(val) < n_val:
        for members in per_class:
            if members and len(val) < n_val:
                val.append(int(members.pop()))
    train = sorted(set(range(len(labels))) - set(val))
    return train, sorted(val)


# ----------------------------------------------------------------------------------------------
# images


def _write_images(out: Path, indices: Sequence[int], rng: np.random.Generator) -> dict[int, int]:
    """Write ``img/NNNNNN.png`` (RGB, bilinear upscale) for each sklearn index; return index -> side (px)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    images = load_digits().images  # (1797, 8, 8) float, values 0..16
    (out / "img").mkdir(parents=True, exist_ok=True)
    sides: dict[int, int] = {}
    for idx in sorted(indices):
        side = int(IMAGE_SIZES[rng.integers(len(IMAGE_SIZES))])
        grey = np.round(images[idx] * (255.0 / 16.0)).astype(np.uint8)
        img = Image.fromarray(grey, mode="L").resize((side, side), Image.Resampling.BILINEAR).convert("RGB")
        img.save(out / "img" / f"{idx:06d}.png", optimize=True)
        sides[idx] = side
    return sides


# ----------------------------------------------------------------------------------------------
# audio


def require_espeak() -> str:
    """Return the path of the ``espeak-ng`` executable.

    Raises RuntimeError (with the install command) when it is not on PATH.
    """
    path = shutil.which("espeak-ng")
    if path is None:
        raise RuntimeError(
            "espeak-ng is required to build the demo audio but was not found on PATH; "
            "install it with `apt-get install -y espeak-ng` (Debian/Ubuntu) or `brew install espeak-ng`"
        )
    return path


def _require_soundfile() -> Any:
    try:
        import soundfile
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("the demo builder needs the `soundfile` package: pip install soundfile") from exc
    return soundfile


def trim_silence(wave: np.ndarray, rel_threshold: float = 0.01, pad: int = 320) -> np.ndarray:
    """Cut leading/trailing samples quieter than ``rel_threshold`` x peak, keeping ``pad`` samples.

    ``wave``: (T,) float samples. Returns a view (T',) with T' <= T. Raises ValueError on an
    all-zero or empty wave.
    """
    loud = np.flatnonzero(np.abs(wave) > rel_threshold * np.abs(wave).max(initial=0.0))
    if loud.size == 0:
        raise ValueError("cannot trim a silent or empty wave")
    return wave[max(int(loud[0]) - pad, 0) : int(loud[-1]) + pad + 1]


def synthesize(utt: Utterance, espeak: str) -> np.ndarray:
    """Speak ``utt`` with espeak-ng; return (T,) float32 at 16 kHz, trimmed, peak 0.9.

    espeak-ng writes 22.05 kHz 16-bit WAV; it is resampled by 320/441 with a polyphase FIR
    (scipy.signal.resample_poly). Raises RuntimeError when espeak-ng fails.
    """
    from scipy.signal import resample_poly

    sf = _require_soundfile()
    cmd = [espeak, "-v", utt.voice, "-s", str(utt.wpm), "--stdout", utt.words]
    proc = subprocess.run(cmd, capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"espeak-ng failed on {cmd!r}: {proc.stderr.decode(errors='replace')}")
    raw, rate = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    if rate != ESPEAK_SAMPLE_RATE or raw.ndim != 1:
        raise RuntimeError(f"espeak-ng produced {rate} Hz, shape {raw.shape}; expected 22050 Hz mono")
    wave = trim_silence(resample_poly(raw, 320, 441).astype(np.float32))
    return (wave * (0.9 / np.abs(wave).max())).astype(np.float32)


def _write_clip(path: Path, wave: np.ndarray) -> None:
    """Store (T,) float wave as 8-bit FLAC (values rounded to multiples of 1/127 of full scale)."""
    sf = _require_soundfile()
    quantised = (np.round(np.clip(wave, -1.0, 1.0) * 127.0).astype(np.int16) * 256).astype(np.int16)
    sf.write(path, quantised, AUDIO_SAMPLE_RATE, format="FLAC", subtype="PCM_S8")


def _write_audio(out: Path, utts: Sequence[Utterance], first_id: int, espeak: str) -> list[dict]:
    """Synthesise and write ``aud/NNNNNN.flac`` (ids from ``first_id``); return per-clip facts.

    A clip longer than 2.5 s is re-spoken 20 words/min faster (deterministic); RuntimeError if it
    is still too long at 300 words/min.
    """
    (out / "aud").mkdir(parents=True, exist_ok=True)
    clips = []
    for k, utt in enumerate(utts):
        wave = synthesize(utt, espeak)
        while wave.size > MAX_CLIP_SECONDS * AUDIO_SAMPLE_RATE:
            if utt.wpm >= 300:
                raise RuntimeError(f"clip {utt} stays longer than {MAX_CLIP_SECONDS} s")
            utt = Utterance(utt.digits, utt.voice, utt.wpm + 20)
            wave = synthesize(utt, espeak)
        rel = f"aud/{first_id + k:06d}.flac"
        _write_clip(out / rel, wave)
        clips.append({"path": rel, "utt": utt, "seconds": wave.size / AUDIO_SAMPLE_RATE})
    return clips


# ----------------------------------------------------------------------------------------------
# records


def _text_sample(rng: np.random.Generator) -> tuple[str, str]:
    """One media-free question with a one-word digit answer (sum, successor or maximum)."""
    kind = int(rng.integers(3))
    if kind == 0:
        a = int(rng.integers(0, 10))
        b = int(rng.integers(0, 10 - a))
        return f"What is {DIGIT_WORDS[a]} plus {DIGIT_WORDS[b]}?", DIGIT_WORDS[a + b]
    if kind == 1:
        a = int(rng.integers(0, 9))
        return f"Which number comes after {DIGIT_WORDS[a]}?", DIGIT_WORDS[a + 1]
    a, b = (int(v) for v in rng.choice(10, size=2, replace=False))
    return f"Which is larger, {DIGIT_WORDS[a]} or {DIGIT_WORDS[b]}?", DIGIT_WORDS[max(a, b)]


def _record(rid: str, task: str, prompt: str, answer: str, images: list, audios: list, meta: dict) -> dict:
    return {
        "id": rid,
        "task": task,
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
        "images": images,
        "audios": audios,
        "meta": meta,
    }


def _make_records(split: str, counts: dict[str, int], images: _Stream, clips: _Stream,
                  labels: np.ndarray, rng: np.random.Generator) -> list[dict]:
    """Records of one split, tasks interleaved in a seeded order.

    Single-modality tasks draw first (distinct items while the pool lasts); image_audio then
    continues the same streams, so it uses the items left over before reusing any.
    """
    def pick(task: str) -> str:
        return PROMPTS[task][int(rng.integers(len(PROMPTS[task])))]

    out = []
    for k in range(counts["image_digit"]):
        i = images.draw()
        out.append(_record(f"{split}-img-{k:05d}", "image_digit", pick("image_digit"),
                           DIGIT_WORDS[labels[i]], [f"img/{i:06d}.png"], [], {"sklearn_index": [i]}))
    for k in range(counts["audio_transcribe"]):
        c = clips.draw()
        out.append(_record(f"{split}-aud-{k:05d}", "audio_transcribe", pick("audio_transcribe"),
                           c["utt"].words, [], [c["path"]], _audio_meta(c)))
    for k in range(counts["image_audio"]):
        i, c = images.draw(), clips.draw()
        out.append(_record(f"{split}-imgaud-{k:05d}", "image_audio", pick("image_audio"),
                           f"{DIGIT_WORDS[labels[i]]} ; {c['utt'].words}", [f"img/{i:06d}.png"],
                           [c["path"]], {"sklearn_index": [i], **_audio_meta(c)}))
    for k in range(counts["text"]):
        prompt, answer = _text_sample(rng)
        out.append(_record(f"{split}-text-{k:05d}", "text", prompt, answer, [], [], {}))
    return [out[j] for j in rng.permutation(len(out))]


def _audio_meta(clip: dict) -> dict:
    return {"voice": [clip["utt"].voice], "wpm": [clip["utt"].wpm], "seconds": [round(clip["seconds"], 4)]}


def _write_jsonl(path: Path, records: Sequence[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, separators=(", ", ": ")) + "\n")


# ----------------------------------------------------------------------------------------------
# tokenizer


def _chatml(messages: Sequence[dict]) -> str:
    """The string CHAT_TEMPLATE renders for ``messages`` (no generation prompt)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def build_tokenizer(texts: Sequence[str], out_dir: Path) -> Any:
    """Train a byte-level BPE (512 ids, GPT-2 pre-tokenisation) on ``texts``; save to ``out_dir``.

    The seven SPECIAL_TOKENS get ids 0..6 (pad=0, bos=1, eos=2) and are never split; the saved
    transformers fast tokenizer carries CHAT_TEMPLATE. Algorithm: byte-pair encoding (Sennrich et
    al., 2016) over UTF-8 bytes (Radford et al., 2019, GPT-2 sec. 2.2). Special tokens are cut out
    of the training text so they take no part in merges. Returns the transformers tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_strip_specials(texts), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
        extra_special_tokens=[IM_START, IM_END, IMAGE_TOKEN, AUDIO_TOKEN],
        chat_template=CHAT_TEMPLATE, model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(out_dir))
    return hf


def _strip_specials(texts: Sequence[str]) -> list[str]:
    pieces = []
    for text in texts:
        for special in SPECIAL_TOKENS:
            text = text.replace(special, "\x00")
        pieces.extend(p for p in text.split("\x00") if p)
    return pieces


# ----------------------------------------------------------------------------------------------
# driver


def build_demo(out: Path, cfg: BuildConfig = BuildConfig(), log: Any = print) -> dict:
    """Rebuild the whole demo set in ``out`` (replacing img/, aud/, tokenizer/ and the files).

    Returns the summary also written to ``build_info.json`` (counts, sizes in bytes, audio seconds,
    versions; no timestamps, so a rebuild with the same versions gives identical files).
    Raises RuntimeError if espeak-ng or soundfile is missing, ValueError for impossible sizes.
    """
    from sklearn.datasets import load_digits

    espeak, t0 = require_espeak(), time.perf_counter()
    _require_soundfile()
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("img", "aud", "tokenizer"):
        shutil.rmtree(out / sub, ignore_errors=True)
    rngs = [np.random.default_rng([cfg.seed, k]) for k in range(9)]
    labels = load_digits().target
    counts = {"train": plan_task_counts(cfg.train_records), "val": plan_task_counts(cfg.val_records)}
    n_val_img = counts["val"]["image_digit"] + counts["val"]["image_audio"]
    img_train, img_val = _split_images(labels, n_val_img, rngs[0])
    sides = _write_images(out, img_train + img_val, rngs[1])
    log(f"wrote {len(sides)} images ({time.perf_counter() - t0:.1f} s)")
    utts = plan_utterances(cfg.train_utterances + cfg.val_utterances, rngs[2])
    clips = _write_audio(out, utts, 0, espeak)
    log(f"wrote {len(clips)} clips ({time.perf_counter() - t0:.1f} s)")
    pools = {"train": (img_train, clips[: cfg.train_utterances]), "val": (img_val, clips[cfg.train_utterances :])}
    records = {}
    for k, (split, (imgs, cl)) in enumerate(pools.items()):
        records[split] = _make_records(split, counts[split], _Stream(imgs, rngs[3 + k]),
                                       _Stream(cl, rngs[5 + k]), labels, rngs[7 + k])
        _write_jsonl(out / f"{split}.jsonl", records[split])
    texts = [_chatml(r["messages"]) for split in records for r in records[split]]
    tokenizer = build_tokenizer(texts, out / "tokenizer")
    summary = {**_summary(out, cfg, records, clips), "tokenizer_vocab": len(tokenizer)}
    (out / "build_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(_readme(summary))
    log(f"wrote the fine-tuning task digit_pair: {build_match_task(out)} records")
    return summary


def _summary(out: Path, cfg: BuildConfig, records: dict, clips: list) -> dict:
    import sklearn
    import soundfile
    import tokenizers
    import transformers

    version = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout.strip()
    sizes = {sub: sum(p.stat().st_size for p in (out / sub).rglob("*") if p.is_file())
             for sub in ("img", "aud", "tokenizer")}
    sizes.update({f: (out / f).stat().st_size for f in ("train.jsonl", "val.jsonl")})
    durations = [c["seconds"] for c in clips]
    return {
        "seed": cfg.seed,
        "config": cfg.__dict__,
        "tasks": {s: {t: sum(r["task"] == t for r in rs) for t in TASK_SHARES} for s, rs in records.items()},
        "files": {"images": len(list((out / "img").glob("*.png"))), "audio_clips": len(clips)},
        "audio_seconds": {"total": round(sum(durations), 2), "mean": round(float(np.mean(durations)), 3),
                          "max": round(max(durations), 3)},
        "bytes": sizes,
        "bytes_total_without_readme": sum(sizes.values()),
        "versions": {"espeak-ng": version, "scikit-learn": sklearn.__version__,
                     "soundfile": soundfile.__version__, "libsndfile": soundfile.__libsndfile_version__,
                     "tokenizers": tokenizers.__version__, "transformers": transformers.__version__},
    }


def _readme(s: dict) -> str:
    t, b, a = s["tasks"], s["bytes"], s["audio_seconds"]
    mb = s["bytes_total_without_readme"] / 1e6
    rows = "\n".join(f"| {task} | {t['train'][task]} | {t['val'][task]} |" for task in TASK_SHARES)
    return f"""# plait demo dataset

Small real multimodal set for the demo job and the tests. Generated by
`python -m plait.data.demo.build --out data/demo --seed {s['seed']}` (30-90 s on a small machine);
do not edit by hand. Versions used: see `build_info.json`.

## Contents ({mb:.1f} MB of file contents; `du` shows more because each small file fills a 4 KiB block)
- `img/NNNNNN.png` ({s['files']['images']} files, {b['img'] / 1e6:.2f} MB): scikit-learn `load_digits` images
  (8x8, grey levels 0..16); file name = sklearn index (also in each record's `meta.sklearn_index`).
  RGB PNG, bilinear upscale to 16x16, 24x24 or 32x32 (one size per image, drawn from the seed),
  bright ink on black.
- `aud/NNNNNN.flac` ({s['files']['audio_clips']} files, {b['aud'] / 1e6:.2f} MB): 1-3 spoken digits synthesised
  with espeak-ng, {SPEEDS_WPM[0]}-{SPEEDS_WPM[-1]} words/min, voices {', '.join(VOICES)};
  16 kHz mono, silence trimmed, peak 0.9, stored as 8-bit FLAC (8-bit samples keep the set small; read with
  `soundfile.read`). Durations: mean {a['mean']} s, max {a['max']} s (limit 2.5 s), total {a['total']} s.
  Files 000000..{s['config']['train_utterances'] - 1:06d} are train, the rest validation.
- `train.jsonl` ({b['train.jsonl'] / 1e6:.2f} MB), `val.jsonl` ({b['val.jsonl'] / 1e6:.2f} MB): one conversation
  per line: `id`, `task`, `messages` (user, assistant), `images`, `audios` (paths relative to this
  folder, in placeholder order), `meta` (sklearn index; voice, speed and seconds of each clip).
  `<image>` / `<audio>` in the user text mark where each item goes.
- `tokenizer/`: byte-level BPE trained on the demo text (prompts, answers, ChatML framing):
  {s['tokenizer_vocab']} ids (the cap is 512; the small demo text runs out of repeated pairs before it).
  Special tokens, one id each: `<|pad|>`=0, `<|bos|>`=1, `<|eos|>`=2, `<|im_start|>`=3, `<|im_end|>`=4,
  `<image>`=5, `<audio>`=6; pad_token `<|pad|>`, eos_token `<|eos|>`, bos_token `<|bos|>` (never added
  automatically). ChatML chat template (`tokenizer/chat_template.jinja`) with the assistant answer +
  `<|im_end|>` inside `{{% generation %}}`, so `return_assistant_tokens_mask=True` marks exactly the
  trained tokens; a generating model therefore stops on `<|im_end|>` (id 4), not on `<|eos|>`.
  Load with `transformers.AutoTokenizer.from_pretrained("data/demo/tokenizer")`.

| task | train | val |
|---|---|---|
{rows}

Train and validation share no sklearn image and no audio file; image_audio records reuse items of
their own split only.

## Licences
- Digit images: UCI "Optical Recognition of Handwritten Digits" (Alpaydin & Kaynak, 1998), as bundled
  with scikit-learn; CC BY 4.0.
- Speech: output of espeak-ng (the program is GPL-3.0-or-later); the clips only speak digit words.

## Rebuild
`apt-get install -y espeak-ng`, `pip install soundfile`, then run the command above. The output is
deterministic for a given seed and the versions in `build_info.json` (another espeak-ng version may
change the audio bytes).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``python -m plait.data.demo.build --out DIR [--seed N]``; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, default=Path("data/demo"), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-records", type=int, default=BuildConfig.train_records)
    p.add_argument("--val-records", type=int, default=BuildConfig.val_records)
    p.add_argument("--train-utterances", type=int, default=BuildConfig.train_utterances)
    p.add_argument("--val-utterances", type=int, default=BuildConfig.val_utterances)
    a = p.parse_args(argv)
    cfg = BuildConfig(a.seed, a.train_records, a.val_records, a.train_utterances, a.val_utterances)
    t0 = time.perf_counter()
    try:
        summary = build_demo(a.out, cfg)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    brief = {k: summary[k] for k in ("tasks", "files", "bytes_total_without_readme")}
    print(json.dumps({**brief, "build_seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

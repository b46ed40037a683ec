"""The job configuration: one dataclass per TOML section, every field documented.

A job file (``configs/*.toml``) maps one to one onto :class:`JobConfig`; :mod:`plait.config.loader` reads
it, applies dotted command-line overrides (``--train.lr=1e-3``) and validates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.planner.cost.types import CHECKPOINT_POLICIES

__all__ = [
    "LoraConfig",
    "VideoConfig",
    "EncoderConfig",
    "LLMConfig",
    "ModelConfig",
    "DataConfig",
    "DataSourceConfig",
    "DATA_FORMATS",
    "PipelineConfig",
    "ParallelConfig",
    "AttentionConfig",
    "TrainConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "EnergyConfig",
    "JobConfig",
    "check_checkpointing",
]


def check_checkpointing(field_name: str, value: str | None, follows: bool) -> None:
    """Refuse an activation checkpointing policy that ``plait.planner.cost.recompute`` does not know.

    Args:
        field_name: the dotted key named in the error (``"train.activation_checkpointing"``).
        value: the policy given.
        follows: whether None is allowed (a per-module override following ``train.activation_checkpointing``).

    Raises:
        ValueError: ``"<field_name> must be one of ('none', 'full', 'selective'), got <value>"``.
    """
    if not (value is None and follows or value in CHECKPOINT_POLICIES):
        raise ValueError(f"{field_name} must be one of {CHECKPOINT_POLICIES}, got {value!r}")


@dataclass
class LoraConfig:
    """LoRA adapters on one Hugging Face part (``[model.llm.lora]``, ``[model.encoders.<name>.lora]``), applied
    with ``peft`` (:func:`plait.models.lora.apply_lora`). With adapters the part's base weights are frozen and
    only the adapters train (the projector trains unless ``freeze_projector``)."""

    r: int = 0
    """Rank of each adapter (``B A`` with ``A: [r, in]``, ``B: [out, r]``); 0 = no LoRA on this part."""
    alpha: float = 16.0
    """Scaling numerator: the adapter's output is multiplied by ``alpha / r``; > 0."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1) (0 keeps every layout bit-comparable with one process)."""
    target_modules: list[str] = field(default_factory=list)
    """Names (last component) of the ``nn.Linear`` modules to adapt; empty = the family's default
    (:data:`plait.models.lora.DEFAULT_TARGETS`: attention q/k/v/o and MLP projections)."""


@dataclass
class VideoConfig:
    """How an image branch takes a record's ``videos`` (``[model.encoders.<name>.video]``, :mod:`plait.data.video`):
    frames are sampled from the stream's header, each sampled frame goes through the branch's image processor, and
    the video's placeholder expands to frames x per-frame features (one image item of the branch per frame)."""

    placeholder: str = "<video>"
    """Placeholder of a video in the text; a single token of the tokenizer (else records with videos are refused;
    a placeholder other than the default that is not a token is refused when the job is built)."""
    fps: float = 1.0
    """Frames sampled per second of video (frame ``k`` is the one shown at ``k / fps`` s); 0: every frame. A video
    gives ``ceil(frames x fps / its frame rate)`` frames (every frame when fps is not below its rate)."""
    max_frames: int = 32
    """Most frames a video may give at ``fps``; a longer video is a bad record naming this field (see
    ``data.on_error``); >= 1."""
    audio: bool = False
    """Whether a video's audio track goes in with its frames, to the model's audio branch: the clip's video and audio
    tokens interleave by chunks of seconds and share time-aligned M-RoPE positions (Qwen2.5-Omni's
    ``use_audio_in_video``). A video without an audio track is then a bad record naming this field."""


@dataclass
class EncoderConfig:
    """One modality encoder branch: a Hugging Face encoder, the feature selection and a projector.

    Exactly one of ``path`` (a local Hugging Face model directory) and ``config`` (a config dict with
    ``model_type``, for a randomly initialised model) must be given.
    """

    modality: str = "image"
    """Kind of input: ``"image"`` (pixel values) or ``"audio"`` (waveforms -> log-mel features)."""
    path: str | None = None
    """Local Hugging Face directory holding the encoder (and its processor files), or None."""
    config: dict[str, Any] | None = None
    """Hugging Face config fields (with ``model_type``) to build a randomly initialised encoder."""
    placeholder: str = ""
    """Placeholder token of this modality in the text; empty means ``"<image>"`` / ``"<audio>"``."""
    feature_layer: int = -1
    """Hidden state that feeds the projector: -1 is the last, -2 the second-to-last (LLaVA) and so on."""
    select: str = "full"
    """``"full"`` keeps every output position; ``"drop_cls"`` removes a leading CLS token (LLaVA default);
    ``"post_norm"`` takes the tower's last hidden state after its post-layernorm (its ``last_hidden_state``, as
    Gemma 3 feeds its projector; ``feature_layer`` -1)."""
    downsample: int = 1
    """Average-pool this many consecutive features into one (audio frames; 1 = off); for a SigLIP tower each
    ``downsample x downsample`` block of patches (Gemma 3's pooling to ``mm_tokens_per_image``)."""
    projector: str = "mlp"
    """``"linear"``, ``"mlp"`` (Linear -> GELU -> Linear, as LLaVA-1.5) or ``"gemma3"`` (Gemma 3's RMSNorm ->
    Linear without bias)."""
    processor: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the Hugging Face image processor / feature extractor (with ``path``: over the folder's)."""
    freeze: bool = False
    """Freeze the encoder (no weight gradient, not in the optimizer)."""
    freeze_projector: bool = False
    """Freeze the projector."""
    lr_scale: float = 1.0
    """Learning rate of this branch's encoder and projector as a multiple of ``train.lr``."""
    activation_checkpointing: str | None = None
    """This branch's activation checkpointing, replacing ``train.activation_checkpointing`` (None: follow it)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the encoder (``r > 0`` turns them on; the encoder's base weights are then frozen)."""
    video: VideoConfig = field(default_factory=VideoConfig)
    """Videos fed to this branch (an image branch): placeholder, frame rate sampled, frame limit."""


@dataclass
class LLMConfig:
    """The causal language model: a local Hugging Face directory or a config to build from."""

    path: str | None = None
    """Local Hugging Face directory of a causal LM, or None."""
    config: dict[str, Any] | None = None
    """Hugging Face config fields (with ``model_type``); ``vocab_size`` is set from the tokenizer."""
    freeze: bool = False
    """Freeze the language model."""
    attn_implementation: str = "sdpa"
    """Attention implementation passed to transformers (``"sdpa"``, ``"eager"``, ...)."""
    activation_checkpointing: str | None = None
    """The LLM's activation checkpointing, replacing ``train.activation_checkpointing`` (None: follow it)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the LLM (``r > 0`` turns them on; the LLM's base weights are then frozen)."""


@dataclass
class ModelConfig:
    """The composite model: a plait checkpoint to start from, or parts to compose."""

    pretrained: str | None = None
    """Directory written by ``MultimodalModel.save_pretrained``; when set, ``llm``/``encoders`` only
    supply freezing flags."""
    llm: LLMConfig = field(default_factory=LLMConfig)
    encoders: dict[str, EncoderConfig] = field(default_factory=dict)
    """Encoder branches by name (e.g. ``vision``, ``audio``)."""

    def __post_init__(self) -> None:
        """Raises ValueError on an unknown ``activation_checkpointing`` of the LLM or an encoder."""
        check_checkpointing("model.llm.activation_checkpointing", self.llm.activation_checkpointing, True)
        for name, enc in self.encoders.items():
            check_checkpointing(f"model.encoders.{name}.activation_checkpointing", enc.activation_checkpointing, True)


DATA_FORMATS = ("jsonl", "llava", "parquet", "arrow")
"""The data file formats (``plait.data.formats``): plait's JSONL records, LLaVA-style JSON, Parquet and Arrow IPC
with embedded media."""


@dataclass
class DataSourceConfig:
    """One source of a training mixture: a ``[[data.sources]]`` entry of the job file."""

    path: str = ""
    """Data file of this source (any format of :data:`DATA_FORMATS`; media paths relative to the file)."""
    weight: float = 1.0
    """Share of the mixture: this source gives ``weight / sum of the weights`` of each epoch's samples (an epoch
    of ``data.epoch_samples``), drawn without replacement from its records and repeated only when its share is
    larger than its records; > 0."""
    format: str = ""
    """One of :data:`DATA_FORMATS`; empty: from the file's extension (``.jsonl``, ``.json``, ``.parquet``,
    ``.arrow``)."""
    name: str = ""
    """The source's name in per-step sample counts and per-source validation; empty: the file's stem. Unique."""
    val: str | None = None
    """Validation file of this source (same format as ``path``, or by its own extension), or None."""


@dataclass
class DataConfig:
    """Where the conversations are and how they become token sequences."""

    train: str = ""
    """Data file of training records (plait's JSONL conversation format, or any of :data:`DATA_FORMATS` by its
    extension; media paths relative to the file). Leave empty when ``sources`` is given."""
    val: str | None = None
    """Data file of validation records, or None (with ``sources``: give each source's ``val`` instead)."""
    sources: list[DataSourceConfig] = field(default_factory=list)
    """A weighted mixture of several data files instead of ``train`` (``[[data.sources]]`` entries with ``path``,
    ``weight``, optional ``format``, ``name``, ``val``), sampled deterministically per (train.seed, epoch)
    (``plait.data.mixture``)."""
    epoch_samples: int = 0
    """Samples per epoch of a mixture (``sources``); 0: the sum of the sources' usable samples."""
    tokenizer: str = ""
    """Local directory of a Hugging Face tokenizer (``tokenizer_config.json`` / ``tokenizer.json``). Empty: the
    LLM's folder, ``model.llm.path`` (or ``<model.pretrained>/tokenizer`` for a plait checkpoint), when it holds a
    tokenizer; an error otherwise."""
    chat_template: str = ""
    """Chat template replacing the tokenizer's own: a path to a Jinja file, or the name of a template committed
    with plait (``plait/data/chat_templates/<name>.jinja``, e.g. ``"chatml"``). Empty: the tokenizer's template.
    Any template works: one that wraps assistant turns in ``{% generation %}`` marks the trained tokens itself;
    for any other (the published ones: Llama-3, Qwen2, Gemma, Mistral, ...) the conversation is rendered turn by
    turn to find each answer and its end-of-turn token (``plait.data.chat_template``). A template that refuses a
    record (a system message for Gemma/Mistral, turns that do not alternate) is a bad record (see on_error)."""
    max_length: int = 512
    """Longest sequence in tokens, placeholders included; longer samples are refused (see on_error)."""
    on_error: str = "raise"
    """``"raise"``: stop at the first bad record with its id and file; ``"skip"``: count, log and skip it."""
    packing: bool = False
    """Pack each microbatch's samples into one row (documents isolated by the attention mask)."""
    shuffle: bool = True
    """Visit training samples in a fresh random order each epoch (False: file order, for tests)."""
    val_max_samples: int | None = None
    """Evaluate on at most this many validation records (the first ones), or all when None."""
    num_workers: int = 2
    """DataLoader worker processes per rank that read, decode and process the samples of the coming steps (and
    compute the metadata pass, ``plait.data.metadata``); 0: in the training process, when a step needs them."""
    prefetch: int = 2
    """Steps each worker loads ahead of the step being trained (DataLoader ``prefetch_factor``)."""
    metadata_cache: str = ""
    """Folder of the metadata pass's cache (keyed by the data files and the processor settings; a stale entry is
    recomputed). Empty: ``$XDG_CACHE_HOME/plait/metadata`` (``~/.cache/plait/metadata``); ``"off"``: no cache."""


@dataclass
class AttentionConfig:
    """Attention masks of the LLM: a token sees the earlier tokens of its own document, never another packed
    document's; ``mask`` says whether the tokens of one modality item also see each other."""

    mask: str = "causal"
    """``"causal"`` (HF LLaVA-style) or ``"bidirectional_items"`` (tokens of one image/clip see each other)."""
    implementation: str = "auto"
    """``"hf"``: the LLM's own attention (causal masks only); ``"plait"`` (flex_attention) or ``"plait_sdpa"``:
    plait's multimodal attention; ``"auto"``: ``"hf"`` when it suffices, else ``"plait_sdpa"`` on CPU and
    ``"plait"`` on GPU (needed for bidirectional items, packing and CP)."""
    block_size: int = 128
    """Tokens per block for the CP token distribution (and flex block masks)."""


@dataclass
class PipelineConfig:
    """Pipeline parallelism (plait.planner.pipeline.plan, plait.parallel.pipeline): the model is cut
    into stages placed on ``degree`` pipeline ranks, and each global batch's microbatches flow through them on a
    schedule. By default every stage has its own rank; ``virtual_stages`` puts several LLM stages on each LLM rank
    and ``attach_encoders`` puts the encoder stages on the first LLM rank (the placements the layout search,
    ``plait.planner.search.layout.plan_layout``, considers; ``pipeline_plan.stage_ranks`` maps them to ranks).
    Combines with context parallelism: each stage is replicated over ``parallel.cp`` ranks that share every
    microbatch's LLM tokens (world size = dp x pp x cp, CP the innermost rank axis)."""

    degree: int = 1
    """Pipeline ranks per model replica (PP degree); 1 disables pipeline parallelism."""
    layout: str = "encoder_parallel"
    """``"encoder_parallel"``: each encoder branch is its own chain of stages feeding the first LLM stage;
    ``"encoders_colocated"``: encoder stage ``s`` runs the ``s``-th chunk of every encoder, then the LLM stages
    follow (one line)."""
    stages: dict[str, int] = field(default_factory=dict)
    """Stages per module, e.g. ``{vision = 1, audio = 1, llm = 2}`` (units cut evenly by count). Modules not
    named get 1 stage per encoder branch (per encoder chunk position when colocated) and the LLM
    ``virtual_stages`` x the ranks left. Ranks: every encoder stage takes one (none with ``attach_encoders`` or
    ``encoders_in_bubble``),
    the LLM ``stages.llm / virtual_stages``; together they must equal ``degree``."""
    virtual_stages: int = 1
    """LLM stages per LLM rank ``v`` (interleaved 1F1B, Narayanan et al., SC'21, section 2.2.2): the LLM is cut
    into ``v`` x (its ranks) stages and LLM stage ``j`` runs on LLM rank ``j mod`` (its ranks), so ``stages.llm``
    (or ``len(splits.llm) + 1``) must be a multiple of ``v``; ``v`` > 1 needs at least 2 LLM ranks and
    ``schedule = "interleaved_1f1b"``; with ``schedule = "zb_v"`` (``v`` = 2) the LLM stages sit in a V instead:
    LLM rank ``i`` of ``p`` holds LLM stages ``i`` and ``2p - 1 - i``. 1: one LLM stage per rank."""
    attach_encoders: bool = False
    """Place every encoder stage on the first LLM rank (pipeline rank 0) instead of ranks of their own: that rank
    runs an encoder's forward just before the first LLM stage's and its backward just after (a frozen encoder
    then costs no rank). Needs encoder branches, ``degree`` >= 2 and ``schedule = "interleaved_1f1b"`` or
    ``"zb_v"``."""
    encoders_in_bubble: bool = False
    """Place the encoder stages on the LLM ranks from the last one back (encoder stage ``k`` on LLM rank
    ``degree - 1 - (k mod degree)``), so that their work runs in those ranks' warm-up and drain bubbles (Optimus,
    ATC'25): the last LLM rank idles for ``degree - 1`` forwards before its first microbatch arrives, and its
    encoder forwards for the first microbatches fill that time. The encoders take no rank of their own; every rank
    holds one LLM stage (``virtual_stages = 1``). Needs encoder branches, ``degree`` >= 2 and one of the
    schedules ``"gpipe"``, ``"1f1b"``, ``"memory_capped_1f1b"``, ``"zb_h1"``, ``"zb_h2"`` (each places an encoder
    action where its rank would otherwise wait); not with ``attach_encoders``."""
    schedule: str = "1f1b"
    """``"gpipe"``, ``"1f1b"`` (multimodal 1F1B), ``"memory_capped_1f1b"`` (needs ``cap`` >= 1), ``"zb_h1"`` /
    ``"zb_h2"`` (zero-bubble: backward split, weight gradients in the bubbles; 1F1B's or about twice its
    activation memory) for one stage per rank; ``"interleaved_1f1b"`` when a rank holds several stages (``virtual_stages`` > 1 or
    ``attach_encoders``; with ``virtual_stages = 1`` it is 1F1B on the LLM ranks with the encoders attached);
    ``"zb_v"`` (the V-shape zero-bubble schedule, Qi et al., NeurIPS 2024: two LLM stages per rank in a V, weight
    gradients in the bubbles, 1F1B's activation memory) with ``virtual_stages = 2``."""
    microbatches: int = 0
    """Microbatches per pipeline per step; 0: derived from ``train.microbatch_size`` as without PP. At most a DP
    replica's share of the global batch (each microbatch needs a sample); more is refused."""
    cap: int = 0
    """Microbatches in flight per backward stage for ``memory_capped_1f1b`` (0 with other schedules)."""
    splits: dict[str, list[str]] = field(default_factory=dict)
    """Explicit stage boundaries per module: the names of the units that start a new stage (in model order,
    the module's first unit excluded), e.g. ``{llm = ["language_model.model.layers.3"]}`` (2 LLM stages cut
    before layer 3). A module named here gets ``len(splits) + 1`` stages (``stages`` may repeat that count;
    for the LLM, all its stages: ``virtual_stages`` x its ranks); ``parallel.plan = "auto"`` writes these when
    its cost-balanced partition is not the even split."""
    encoder_dp: dict[str, int] = field(default_factory=dict)
    """Data-parallel degree of an encoder branch inside each pipeline, e.g. ``{vision = 2}``: every stage of that
    branch runs as that many replica stages, each on its own pipeline rank (or, with ``encoders_in_bubble``, on
    different LLM ranks), each encoding an equal (cost-balanced) share of every microbatch's items of the branch;
    the first LLM stage joins their features in item order, and a trainable branch's gradients are summed over its
    replicas (and the pipelines' DP copies). Each stage of a branch then takes ``encoder_dp[branch]`` ranks of
    ``degree``. Branches not named: 1. ``encoder_parallel`` layout only; not with ``attach_encoders``,
    ``virtual_stages`` > 1, ``parallel.dp_shard`` > 1 or ``plait launch``; the step plans no deferred samples.
    With ``parallel.plan = "auto"`` the search chooses it (each branch up to ``train.microbatch_size`` replicas, as
    ``plait plan``); a branch named here is replicated at most that many times there (1: not replicated)."""
    encoder_tp: dict[str, int] = field(default_factory=dict)
    """Tensor-parallel degree of an encoder branch inside each pipeline, e.g. ``{vision = 2}``: every stage of that
    branch runs on that many pipeline ranks of its own as one TP group (its tower's attention heads and MLPs, and
    an MLP projector, split by the family's encoder TP plan), each running every item of the branch; the group's
    first rank sends the features to the first LLM stage, whose gradient reaches every rank of the group. Each
    stage of a branch then takes ``encoder_tp[branch]`` ranks of ``degree``. Branches not named: 1. The degree
    must divide the tower's heads; ``encoder_parallel`` layout only; not with ``encoder_dp`` above 1 on the same
    branch, ``attach_encoders``, ``encoders_in_bubble``, ``virtual_stages`` > 1, ``parallel.tp`` > 1,
    ``parallel.dp_shard`` > 1 or ``plait launch``; the step plans no deferred samples."""


@dataclass
class ParallelConfig:
    """Degrees of parallelism: world size = dp x dp_shard x pp x cp x tp. ``dp`` = 0 means world size /
    (dp_shard x pp x cp x tp). Rank layout: :class:`plait.parallel.dims.ParallelDims`."""

    dp: int = 0
    """Data-parallel replicas (full model copies, or HSDP replica groups when ``dp_shard`` > 1); 0: derived."""
    dp_shard: int = 1
    """FSDP2 shard degree: each parameter, gradient and AdamW state is split over ``dp_shard`` ranks that each
    train on their own samples (``torch.distributed.fsdp.fully_shard`` per pipeline unit). HSDP (shard within a
    group, replicate across groups) when ``dp`` > 1 too."""
    offload: str = "none"
    """FSDP2 CPU offload: ``"none"`` or ``"cpu"`` (``fully_shard(offload_policy=CPUOffloadPolicy())``: the sharded
    parameters, their gradients and the AdamW state live in host memory, pinned on CUDA; each group's shard is
    copied to the device before its all-gather, its reduce-scattered gradient back to the host, and the optimizer
    step runs on the host). Needs ``dp_shard`` > 1 (FSDP2 wrapping) and ``pp.degree`` = 1 (under pipeline stages the
    stage's parameters stay whole on the device through the step, so offloading would save only the optimizer
    state: not supported)."""
    fsdp_reduce: str = "step"
    """When FSDP2 without pipeline stages reduce-scatters gradients over a step's microbatches: ``"step"`` (gradient
    sync off until the last microbatch: every trainable unit's gradient accumulates unsharded on the device, one
    reduce-scatter per step) or ``"microbatch"`` (a reduce-scatter after every microbatch's backward, the shards
    accumulate: one unit's unsharded gradient at a time, ``M`` reductions per step). ``plait plan`` and
    ``parallel.plan = "auto"`` choose it (``planner.search_parallel.flat_reduce``). ``"microbatch"`` needs
    ``dp_shard`` > 1 and ``pp.degree`` = 1; CPU offload always reduces every microbatch."""
    fsdp_reshard: str = "auto"
    """When FSDP2 without pipeline stages frees each unit's all-gathered parameters: ``"after_forward"`` (gathered
    again for the backward: two all-gathers per unit per microbatch, one unit's whole parameters held at a time) or
    ``"after_backward"`` (kept from the unit's forward to its backward: one all-gather per unit per microbatch, the
    whole parameters of every trainable unit held at the end of the forward; ``fully_shard(...,
    reshard_after_forward=False)``). ``"auto"``: the planner's choice (``parallel.plan = "auto"`` writes it, ``plait
    plan`` prints it: ``"after_backward"`` when the memory cap allows); a manual job with ``"auto"`` reshards after
    the forward. The explicit values need ``dp_shard`` > 1 and ``pp.degree`` = 1 (under pipeline stages each
    stage's parameters are gathered once per step and kept whole until its reduction)."""
    tp: int = 1
    """Tensor-parallel degree: the attention heads and MLPs of every layer are split over ``tp`` ranks."""
    ep: int = 1
    """Expert-parallel degree: the experts of every mixture-of-experts LLM layer are split over ``ep`` ranks of the
    data-parallel axis (``ep`` divides ``dp x dp_shard``), each token sent to the rank holding its expert and back
    by all-to-all; the other parameters keep their DP / FSDP2. Needs an LLM with MoE layers whose expert count
    ``ep`` divides, and ``tp`` = ``cp`` = 1."""
    cp: int = 1
    """Context-parallel degree: the LLM tokens of each microbatch are spread over ``cp`` ranks."""
    cp_distribution: str = "lpt"
    """Token distribution over CP ranks: ``"uniform"``, ``"zigzag"``, ``"lpt"`` (attention workload
    balanced) or ``"ilp"`` (LPT refined by HiGHS)."""
    backend: str = "auto"
    """``"gloo"``, ``"nccl"`` or ``"auto"`` (NCCL when CUDA is available, else gloo)."""
    timeout_s: float = 300.0
    """Collective timeout in seconds."""
    rank_order: str = "auto"
    """How ranks are numbered over the parallel axes (``plait.parallel.dims.ParallelDims``): ``"dp_outer"`` (dp,
    dp_shard, pp, cp, tp, outermost first: TP innermost, the data-parallel axes outermost), ``"pp_outer"`` (the
    pipeline outermost, Megatron-LM's and torchtitan's order: the FSDP2 shard and TP groups of a pipeline rank on
    consecutive ranks) or ``"auto"``: ``"pp_outer"`` when it keeps the heavier groups (TP, CP, FSDP2 shards, DP)
    inside nodes that ``"dp_outer"`` would cross (``plait.planner.cost.topology.plan_rank_order``), else
    ``"dp_outer"``; on one node always ``"dp_outer"``."""
    gpus_per_node: int = 0
    """Processes (GPUs) per node, for ``rank_order = "auto"``; 0: ``torchrun``'s ``LOCAL_WORLD_SIZE``, or all the
    processes on one node when it is not set."""
    pp: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline parallelism (``[parallel.pp]``)."""
    plan: str = "manual"
    """``"manual"``: use ``dp`` and ``[parallel.pp]`` as written. ``"auto"``: ``plait train`` profiles the model
    on this machine (``plait.measure.unit_timing``, reusing a stored profile whose key matches), searches layout,
    stages per module, partition and DP degree for the world size (``plait.planner.search.layout.plan_layout``),
    writes the result into ``dp`` and ``[parallel.pp]`` (1F1B, or interleaved 1F1B with ``virtual_stages`` /
    ``attach_encoders`` when such a plan is faster) and prints it before building the trainer."""


@dataclass
class TrainConfig:
    """Optimisation and the training loop."""

    seed: int = 0
    global_batch_size: int = 32
    """Samples per optimizer step over all DP ranks."""
    microbatch_size: int = 8
    """Samples per forward/backward on one rank; the rest is gradient accumulation."""
    microbatch_policy: str = "hierarchical"
    """How a global batch is assigned to DP ranks and microbatches: ``"arrival"`` (file/shuffle order),
    ``"random"``, ``"lpt"`` (total cost) or ``"hierarchical"`` (per-module balance, plait.planner.microbatch)."""
    steps: int = 0
    """Optimizer steps; 0 means ``epochs`` full passes."""
    epochs: float = 1.0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of ``lr``."""
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    dtype: str = "auto"
    """``"fp32"``, ``"bf16"`` (autocast) or ``"auto"`` (bf16 on GPU, fp32 on CPU)."""
    eval_every: int = 0
    """Validate every this many steps (0: only at the end). Validation runs through the job's own layout
    (``plait.train.evaluation``): the teacher-forced loss per task and overall (sum of token cross-entropies /
    target tokens of the whole validation set), greedy answers scored by exact match per task and overall and by
    ``eval_metrics``, the samples shared over DP ranks, pipeline jobs through their stages (no rank builds the
    whole model). Results go to ``metrics.jsonl``; the answers to ``<run_dir>/predictions/step_<N>.jsonl``."""
    max_new_tokens: int = 16
    """Tokens generated per validation answer."""
    eval_batch_size: int = 0
    """Validation samples per forward pass on one rank (one task per batch); 0: ``max(microbatch_size, 16)``."""
    eval_metrics: list[str] = field(default_factory=list)
    """Extra validation metrics, each ``"package.module:function"`` (importable from the job's environment),
    called as ``function(predictions: list[str], references: list[str])`` returning a float or a dict of floats
    (``{"bleu": 0.4, "bleu_brevity": 0.9}``); reported for all samples and per task under ``val_metrics`` in
    ``metrics.jsonl`` as ``<name>`` and ``<name>/<task>``, ``<name>`` being the function's name (or the dict's
    keys). Example: ``eval_metrics = ["mypkg.metrics:bleu"]``."""
    device: str = "auto"
    """``"cpu"``, ``"cuda"`` or ``"auto"``."""
    threads: int = 0
    """torch intra-op threads per process (0: automatic: ``OMP_NUM_THREADS`` when set, as ``torchrun`` sets it to 1 per
    worker; else this process's share of the host's cores that no other work keeps busy, from the load average)."""
    activation_checkpointing: str = "none"
    """Recompute layer activations in the backward instead of keeping them (``plait.planner.cost.recompute``):
    ``"none"``; ``"full"``: every transformer layer unit of the encoders and the LLM keeps only its input and runs
    its forward again in the backward (PyTorch's non-reentrant ``torch.utils.checkpoint``); ``"selective"``: every
    other layer unit of each module (the 0th, 2nd, ... of its chain), about half the memory saving for half the
    recomputation, with costs the planner prices exactly. Frozen-aware: a unit that runs no backward (frozen,
    nothing trainable upstream) is never checkpointed (it keeps nothing already). Per module:
    ``[model.llm] activation_checkpointing`` and ``[model.encoders.<name>] activation_checkpointing``."""

    def __post_init__(self) -> None:
        """Raises ValueError on an unknown ``activation_checkpointing``."""
        check_checkpointing("train.activation_checkpointing", self.activation_checkpointing, False)


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (torch.distributed.checkpoint)."""

    every: int = 0
    """Save every this many steps (0: only at the end)."""
    keep: int = 2
    """Checkpoints kept on disk (older ones are removed; 0 keeps all)."""
    merge_lora: bool = False
    """Write ``final/`` with the LoRA adapters merged into the base weights (plain Hugging Face parts, no
    adapter folders); false keeps each adapted part's base and its adapter in ``peft``'s format."""


@dataclass
class MetricsConfig:
    """Where a run writes its metrics, plots and checkpoints."""

    run_dir: str = "runs/job"
    """The run's folder (metrics.jsonl, checkpoints/, final/, plots). A job file that does not set it gets
    ``runs/<job file name without .toml>`` (``plait.config.loader.read_config_data``); this default is for
    configs built in code. A new run refuses a folder holding an earlier run's checkpoints or final model unless
    ``plait train --overwrite``."""
    log_every: int = 1
    """Write a metrics row every this many steps (and at the last step)."""
    tensorboard: bool = True
    """Also write TensorBoard events when ``torch.utils.tensorboard`` is importable
    (``pip install -e ".[tensorboard]"``)."""
    wandb: bool = False
    """Also log every metrics row to Weights & Biases (``pip install -e ".[wandb]"``; an error when not installed)."""
    wandb_project: str = ""
    """The Weights & Biases project (empty: wandb's default, or ``$WANDB_PROJECT``)."""
    progress: bool = True
    """Show a progress bar on rank 0."""


@dataclass
class EnergyConfig:
    """Energy (Perseus, Chung et al., SOSP 2024): per-action GPU frequencies from a frequency plan in the pipeline
    runtime (``plait.parallel.energy``), and the reaction to a straggler DP replica
    (``plait.planner.resilience.straggler``)."""

    plan: str = ""
    """Frequency plan JSON written by ``plait energy`` (``plait.planner.energy.types.EnergyPlan``); empty: off.
    Pipeline jobs only (``parallel.pp.degree`` > 1): before each F/B/W action the runtime locks the GPU's SM clock
    at the plan's frequency (needs SYS_ADMIN and ``pip install -e ".[energy]"``; where refused it says so once and
    records only); on CPU it records the would-be frequency in the measured timeline (``frequency_mhz``)."""
    straggler: bool = True
    """React to a slow DP replica: the others switch to the frontier point at its iteration time, and back to the
    fastest point when it recovers (one all_gather of a float per step)."""
    slow_ratio: float = 1.15
    """A step counts as slow when the slowest replica's time over the fastest's (each relative to its plan point's
    iteration time) is at least this (> ``recover_ratio``)."""
    recover_ratio: float = 1.05
    """A step counts as recovered when that ratio is at most this (>= 1)."""
    patience: int = 3
    """Consecutive slow (recovered) steps before switching (switching back), >= 1."""


@dataclass
class JobConfig:
    """A whole training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    energy: EnergyConfig = field(default_factory=EnergyConfig)
    """Frequency plan and straggler reaction (``[energy]``)."""

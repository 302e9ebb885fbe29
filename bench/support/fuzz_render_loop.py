"""A case's set-up and training loop as source text, in each mode (:mod:`fuzz_render` puts the script together).

Why two renderers for one loop: the two modes protect the same training written two ways. Transparent mode gets
what a user writes for plain torch (``init_process_group``, DDP or ``init_device_mesh`` + ``fully_shard``, a
``DataLoader`` over a ``DistributedSampler``, ``no_sync`` or ``set_requires_gradient_sync`` accumulation counted
with ``enumerate``, the script's own ``dist.all_reduce`` gated on the loop index, ``AveragedModel`` for the EMA);
model-aware mode gets the TorchPass API (``tp.init``, ``ctx.wrap_model``/``ctx.wrap_fsdp``,
``ctx.wrap_optimizer``, ``ctx.register``, ``ctx.steps`` over a ``tp.StepLoader``, ``ctx.all_reduce``, the EMA
updated in ``ctx.on_commit``). The micro-batch body and the update are shared, so both modes train alike.
"""

from __future__ import annotations

from .fuzz_grammar import Case


def _indent(lines: list[str], by: int) -> list[str]:
    return [(" " * by + line) if line else line for line in lines]


def _micro_batch(case: Case, net: str, x: str, y: str) -> list[str]:
    """Forward and backward of one micro-batch (``last``: the window's last, the one that synchronises)."""
    forward = [f"logits = {net}({x})"]
    if case.precision in ("autocast_bf16", "scaler_fp16"):
        dtype = "torch.bfloat16" if case.precision == "autocast_bf16" else "torch.float16"
        forward = [f'with torch.autocast("cpu", dtype={dtype}):', *_indent(forward, 4)]
    body = [
        *forward,
        f"loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), {y}.reshape(-1)) / ACCUMULATE",
        "scaler.scale(loss).backward()" if case.precision == "scaler_fp16" else "loss.backward()",
    ]
    if case.accumulation == "no_sync":
        return [f"with nullcontext() if last else {net}.no_sync():", *_indent(body, 4)]
    if case.accumulation == "sync_off":
        return ["model.set_requires_gradient_sync(last)", *body]
    return body


def _report(case: Case) -> list[str]:
    """The all-reduce of the loss that ReduceLROnPlateau steps on (every PLATEAU_EVERY-th optimizer step)."""
    if case.mode == "transparent":
        return [
            "if report:",
            "    reported = loss.detach().clone()",
            "    dist.all_reduce(reported)",
        ]
    return ["reported = loss.detach().clone()", "reported_ok = report and ctx.all_reduce(reported)"]


def _update(case: Case) -> list[str]:
    """The optimizer step of a window, with what goes around it."""
    scaler = case.precision == "scaler_fp16"
    lines: list[str] = []
    if case.scheduler == "plateau" and not case.plateau_after_update:
        lines += _report(case)
    if scaler and case.clip:
        lines += ["for opt in optimizers:", "    scaler.unscale_(opt)"]
    if case.clip:
        lines.append("torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)")
    lines += ["for opt in optimizers:", "    scaler.step(opt)" if scaler else "    opt.step()"]
    if scaler:
        lines.append("scaler.update()")
    lines += ["for opt in optimizers:", "    opt.zero_grad()"]
    if case.scheduler == "per_step":
        lines.append("scheduler.step()")
    if case.scheduler == "per_epoch" and case.mode == "aware":
        lines += ["if (step + 1) % STEPS_PER_EPOCH == 0:", "    scheduler.step()"]
    if case.ema and case.mode == "transparent":
        lines.append("ema.update_parameters(model)")
    if case.scheduler == "plateau":
        if case.plateau_after_update:
            lines += _report(case)
        ok = "report" if case.mode == "transparent" else "reported_ok"
        lines += [f"if {ok}:", "    scheduler.step(reported.item() / world)"]
    return lines


def _scheduler(case: Case) -> list[str]:
    built = {
        "per_step": "torch.optim.lr_scheduler.LambdaLR(optimizers[0], lambda s: min(1.0, (s + 1) / 4))",
        "per_epoch": "torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=0.7)",
        "plateau": "torch.optim.lr_scheduler.ReduceLROnPlateau(optimizers[0], factor=0.5, patience=0, threshold=0.0)",
    }
    if case.scheduler == "none":
        return []
    if case.mode == "aware":
        return [f'scheduler = ctx.register("scheduler", {built[case.scheduler]})']
    return [f"scheduler = {built[case.scheduler]}"]


def _scaler(case: Case) -> list[str]:
    if case.precision != "scaler_fp16":
        return []
    built = 'torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=3)'
    return [f'scaler = ctx.register("scaler", {built})' if case.mode == "aware" else f"scaler = {built}"]


HOOKS = [
    'model.blocks[0].register_forward_pre_hook(lambda *_: maybe_kill("forward"))',
    'model.blocks[0].register_full_backward_hook(lambda *_: maybe_kill("backward"))',
    'optimizers[0].register_step_pre_hook(lambda *_: maybe_kill("optimizer"))',
    'optimizers[-1].register_step_post_hook(lambda *_: maybe_kill("update"))',
    'optimizers[0].register_step_post_hook(lambda *_: maybe_kill("between"))',
]


def _frozen(case: Case) -> list[str]:
    return ["for p in model.norm.parameters():", "    p.requires_grad_(False)  # frozen"] if case.frozen else []


def transparent_body(case: Case) -> str:
    """An unmodified torch script: nothing from TorchPass."""
    replicas, shards = case.mesh
    lines = [
        "",
        'dist.init_process_group(backend="gloo")',
        "rank, world = dist.get_rank(), dist.get_world_size()",
        'mark(f"pid-slot{rank}-{os.getpid()}")',
        "torch.manual_seed(1234)",
        "model = TinyLM()",
        *_frozen(case),
    ]
    if case.ema:
        lines.append("ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))")
    if case.sharded:
        if replicas == 1:
            lines.append(f'mesh = init_device_mesh("cpu", ({shards},), mesh_dim_names=("dp_shard",))')
        else:
            shape = f"({replicas}, {shards})"
            lines.append(f'mesh = init_device_mesh("cpu", {shape}, mesh_dim_names=("dp_replicate", "dp_shard"))')
        policy = ""
        if case.precision == "bf16_policy":
            lines.append("policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
            policy = ", mp_policy=policy"
        lines += [
            "for block in model.blocks:",
            f"    fully_shard(block, mesh=mesh{policy})",
            f"fully_shard(model, mesh=mesh{policy})",
            "net = model",
        ]
    else:
        lines.append("net = DDP(model)")
    lines += ["optimizers = make_optimizers(model)", *HOOKS, *_scheduler(case), *_scaler(case)]
    lines += [
        "dataset = make_dataset()",
        f"sampler = DistributedSampler(dataset, shuffle=True, seed=3, drop_last={case.drop_last})",
        "loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)",
        "windows = -(-len(loader) // ACCUMULATE)",
        "",
        "for epoch in range(EPOCHS):",
        "    sampler.set_epoch(epoch)",
        "    for i, (x, y) in enumerate(loader):",
        "        at = epoch * len(loader) + i",
        '        mark(f"mark-slot{rank}-{at}")',
        "        last = (i + 1) % ACCUMULATE == 0 or i + 1 == len(loader)",
        *_indent(_micro_batch(case, "net", "x", "y"), 8),
        "        if not last:",
        "            continue",
    ]
    if case.scheduler == "plateau":
        lines.append("        report = (epoch * windows + i // ACCUMULATE) % PLATEAU_EVERY == 0")
    lines += _indent(_update(case), 8)
    if case.scheduler == "per_epoch":
        lines.append("    scheduler.step()")
    return "\n".join(lines) + "\n"


_EMA_CLASS = [
    "",
    "class Ema:",
    '    """An EMA of the weights (under FSDP2: this rank\'s shards), registered, updated once per committed step."""',
    "",
    "    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:",
    "        self.decay, self.updates = decay, 0",
    "        self.shadow = {n: local(p).float() for n, p in model.named_parameters()}",
    "",
    "    @torch.no_grad()",
    "    def update(self, model: nn.Module) -> None:",
    "        for n, p in model.named_parameters():",
    "            self.shadow[n].lerp_(local(p).float(), 1 - self.decay)",
    "        self.updates += 1",
    "",
    "    def state_dict(self) -> dict:",
    '        return {"shadow": self.shadow, "updates": self.updates}',
    "",
    "    def load_state_dict(self, state: dict) -> None:",
    '        for n, t in state["shadow"].items():',
    "            self.shadow[n].copy_(t)",
    '        self.updates = int(state["updates"])',
    "",
]


def aware_body(case: Case) -> str:
    """The same training written with the TorchPass API."""
    replicas, shards = case.mesh
    lines = [*(_EMA_CLASS if case.ema else []), "", "ctx = tp.init()"]
    lines += [
        "rank, world = ctx.slot, ctx.world_size",
        'mark(f"pid-slot{rank}-{os.getpid()}")',
        "torch.manual_seed(1234)",
        "model = TinyLM()",
        *_frozen(case),
    ]
    if case.sharded:
        policy = ""
        if case.precision == "bf16_policy":
            policy = ", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
        lines += [
            f"model = ctx.wrap_fsdp(model, mesh_shape=({replicas}, {shards}), shard=Block{policy})",
            "net = model",
        ]
    else:
        lines.append("net = ctx.wrap_model(model)")
    lines += ["optimizers = [ctx.wrap_optimizer(opt) for opt in make_optimizers(model)]", *HOOKS]
    lines += [*_scheduler(case), *_scaler(case)]
    if case.ema:
        lines += ['ema = ctx.register("ema", Ema(model))', "ctx.on_commit(lambda step: ema.update(model))"]
    lines += [
        "loader = tp.StepLoader(make_dataset(), batch_size=BATCH * ACCUMULATE, seed=3)",
        "",
        "for step, (x, y) in ctx.steps(loader, STEPS):",
        "    at = step",
        '    mark(f"mark-slot{rank}-{at}")',
        "    for micro in range(ACCUMULATE):",
        "        last = micro == ACCUMULATE - 1",
        "        xm, ym = x[micro * BATCH : (micro + 1) * BATCH], y[micro * BATCH : (micro + 1) * BATCH]",
        *_indent(_micro_batch(case, "net", "xm", "ym"), 8),
    ]
    if case.scheduler == "plateau":
        lines.append("    report = step % PLATEAU_EVERY == 0")
    lines += _indent(_update(case), 4)
    return "\n".join(lines) + "\n"

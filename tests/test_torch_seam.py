"""Private torch is read in one place (``fpaudit.torch_internals``), and works there.

Two halves. The first reads fpaudit's source (no torch release involved) and fails
on any read of a private torch name outside the seam modules: a private module
imported, a private attribute of ``torch`` or its submodules, a private attribute
(or ``getattr`` of one) that torch's objects have and fpaudit does not define
itself, or a string naming a private torch module. The second runs every entry of
the seam on the torch that runs the tests, so ``make test-release RELEASE=X``
tells on each release which private name moved.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp
import torch.utils.cpp_extension
from torch import nn

from fpaudit import torch_internals as internals

PACKAGE = Path(__file__).resolve().parent.parent / "fpaudit"
SEAM = {"torch_internals.py", "torch_internals_compile.py"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> frozenset[str]:
    """Private attribute names that torch's objects carry (modules, classes and real
    instances of the ones fpaudit touches), by introspection of this release."""
    layer = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.ones(2, requires_grad=True)
    node = (x * 2).grad_fn
    objects: list[object] = [
        torch, torch._C, torch.autograd, torch.autograd.graph, torch.nn.utils, torch.amp,
        torch.utils.cpp_extension, torch.Tensor, x, layer, nn.Module, optimizer, scheduler,
        scaler, node, torch.ops.aten.add.Tensor, torch.distributed.fsdp.FullyShardedDataParallel,
    ]  # fmt: skip
    try:  # Lightning's private names are read through the seam too (fpaudit[lightning])
        import lightning.pytorch as pl
        from lightning.pytorch.loops import _FitLoop

        objects += [pl.LightningModule(), _FitLoop]
    except ImportError:
        pass
    names = {n for o in objects for n in dir(o) if _private(n)}
    names |= {n for o in (scaler, scheduler, optimizer) for n in vars(o) if _private(n)}
    # Set on instances in torch's own constructors, out of introspection's reach here.
    names |= {"_is_flat_param", "_flat_param"}
    return frozenset(names)


def _defined_by_fpaudit(trees: list[ast.Module]) -> set[str]:
    """Names fpaudit defines itself (functions, classes, attributes it sets, arguments):
    an access to one of these is fpaudit's own, whatever torch also has."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


_TORCH_MODULE_STRING = re.compile(r"^torch(\.\w+)*\._\w")


def private_reads(source: str, torch_private: frozenset[str], own: set[str]) -> list[str]:
    """Every read of a private torch name in ``source``, as 'line: what'."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = (node.module or "").split(".")
            if any(map(_private, parts)) or any(_private(a.name) for a in node.names):
                what = f"from {node.module} import ..."
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(map(_private, parts)):
                    what = f"import {alias.name}"
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            root = base.id if isinstance(base, ast.Name) else None
            dotted = ".".join([str(root), *reversed(chain)])
            # torch.ops.aten._to_copy is an op's name, not a private attribute
            of_torch = root == "torch" and "ops" not in chain
            of_torch_object = root not in ("self", "cls", "torch") and node.attr in torch_private
            if of_torch or (of_torch_object and node.attr not in own):
                what = dotted
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            if _private(name) and name in torch_private and name not in own:
                what = f"{node.func.id}(..., {name!r})"
        elif isinstance(node, ast.Constant) and _TORCH_MODULE_STRING.match(str(node.value)):
            what = repr(node.value)
        if what is not None:
            found.append((getattr(node, "lineno", 0), what))
    return [f"{line}: {what}" for line, what in sorted(set(found))]


@pytest.fixture(scope="module")
def torch_private() -> frozenset[str]:
    return _torch_private_attributes()


def test_private_torch_is_read_only_in_the_seam(torch_private: frozenset[str]) -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    trees = [ast.parse(f.read_text()) for f in files]
    own = _defined_by_fpaudit(trees)
    offenders = {
        str(f.relative_to(PACKAGE.parent)): reads
        for f in files
        if f.name not in SEAM and (reads := private_reads(f.read_text(), torch_private, own))
    }
    assert offenders == {}, "read private torch through fpaudit.torch_internals"


def test_the_scan_finds_each_kind_of_private_read(torch_private: frozenset[str]) -> None:
    """The scanner is not vacuous: each way of reaching private torch is caught, and
    public torch, aten op names and fpaudit's own private names are not."""
    source = (
        "import torch\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"  # 2
        "import torch._dynamo\n"  # 3
        "node = torch._C._current_autograd_node()\n"  # 4
        "scale = scaler._per_optimizer_states\n"  # 5
        "tracker = getattr(scaler, '_scale', None)\n"  # 6
        "loaded = 'torch._dynamo' in sys.modules\n"  # 7
        "fine = torch.ops.aten._to_copy.default\n"
        "public = torch.autograd.backward\n"
        "mine = report._held\n"
        "also = self._scale\n"
    )
    found = private_reads(source, torch_private, own={"_held"})
    assert sorted({int(line.split(":")[0]) for line in found}) == [2, 3, 4, 5, 6, 7], found


def test_the_seam_lists_each_private_name_it_reads() -> None:
    """The seam's docstring names every private name its code reads (attributes,
    ``getattr`` strings, modules imported), so the list a maintainer checks is whole."""
    tree = ast.parse(inspect.getsource(internals))
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            read.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            read |= {p for p in (node.module or "").split(".") if _private(p)}
            read |= {a.name for a in node.names if _private(a.name)}
        elif isinstance(node, ast.Constant) and re.fullmatch(r"_[a-z]\w*", str(node.value)):
            read.add(str(node.value))
    assert {"_C", "_engine_run_backward", "_sequence_nr", "_schema", "_scale"} <= read
    doc = internals.__doc__ or ""
    assert sorted(n for n in read if n not in doc) == []


# -- the seam on this release -----------------------------------------------------------
def test_engine_entry_is_wrapped_and_restored() -> None:
    calls: list[bool] = []

    def make(original, signature):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(internals.create_graph(signature, args, kwargs))
            return original(*args, **kwargs)

        return run

    original = getattr(torch.autograd, internals.ENGINE_ENTRY)
    restore = internals.wrap_engine_entry(make)
    assert restore is not None, f"torch {torch.__version__} has no {internals.ENGINE_ENTRY}"
    try:
        x = torch.ones(3, requires_grad=True)
        (x * 2).sum().backward()
        (g,) = torch.autograd.grad((x * x).sum(), x, create_graph=True)
        g.sum().backward()
    finally:
        restore()
    assert getattr(torch.autograd, internals.ENGINE_ENTRY) is original
    assert calls == [False, True, False]
    # 1 + 2 from the first two backwards, then d/dx sum(2x) = 2: x.grad = 2 + 2 = 4
    assert x.grad is not None and x.grad.tolist() == [4.0, 4.0, 4.0]


def test_node_and_sequence_numbers() -> None:
    assert internals.current_autograd_node() is None
    before = internals.autograd_sequence_number()
    x = torch.ones(2, requires_grad=True)
    y = x * 3
    assert y.grad_fn is not None
    assert internals.node_sequence_number(y.grad_fn) == before
    assert internals.autograd_sequence_number() == before + 1
    seen: list[str] = []

    class Mode(internals.TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            node = internals.current_autograd_node()
            seen.append(type(node).__name__ if node is not None else "none")
            return func(*args, **(kwargs or {}))

    with Mode():
        y.sum().backward()
    assert "MulBackward0" in seen
    accumulate = y.grad_fn.next_functions[0][0]
    assert internals.node_sequence_number(accumulate) == 2**64 - 1  # AccumulateGrad


def test_op_schemas() -> None:
    aten = torch.ops.aten
    assert isinstance(aten.add_.Tensor, internals.OpOverload)
    assert internals.is_mutable(aten.add_.Tensor) and not internals.is_mutable(aten.add.Tensor)
    assert internals.written_arguments(aten.add_.Tensor) == ((0, "self"),)
    assert internals.written_arguments(aten.mm.out) == ((2, "out"),)
    assert internals.written_arguments(aten._foreach_mul_.Scalar) == ((0, "self"),)


def test_op_callers_and_the_tensor_places_of_schemas() -> None:
    aten = torch.ops.aten
    x, y = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.5])
    assert torch.equal(internals.op_caller(aten.mul.Tensor)(x, y), aten.mul.Tensor(x, y))
    assert torch.equal(internals.op_caller(aten.add.Tensor)(x, y, alpha=2), x + 2 * y)
    assert internals.tensor_argument_positions(aten.mm.default) == ((0, 1), ())
    assert internals.tensor_argument_positions(aten.t.default) == ((0,), ())
    assert internals.tensor_argument_positions(aten.cat.default) == ((), (0,))
    assert internals.tensor_argument_positions(aten.index.Tensor) == ((0,), (1,))
    layer_norm = internals.tensor_argument_positions(aten.native_layer_norm_backward.default)
    assert layer_norm == ((0, 1, 3, 4, 5, 6), ())  # Tensor? weight and bias too
    assert internals.tensor_argument_positions(aten.add.Tensor) == ((0, 1), ())


def test_parameters_of_is_where_getattr_finds_a_parameter() -> None:
    layer = nn.Linear(2, 2)
    found = internals.parameters_of(layer)
    assert found["weight"] is layer.weight and found["bias"] is layer.bias
    replaced = nn.Parameter(torch.zeros(2))
    dict.__setitem__(found, "bias", replaced)  # a swap no registration hook sees
    assert layer.bias is replaced


def test_grad_descriptor_reads_and_writes_grad() -> None:
    descriptor = internals.grad_descriptor()
    x = torch.zeros(2, requires_grad=True)
    assert descriptor.__get__(x) is None
    descriptor.__set__(x, torch.ones(2))
    assert x.grad is not None and x.grad.tolist() == [1.0, 1.0]


def test_grad_scaler_state() -> None:
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert internals.scaler_scale(scaler) is None  # lazily made at the first scale()
    assert internals.scaler_init_scale(scaler) == 1024.0
    loss = layer(torch.ones(1, 2)).sum()
    scaler.scale(loss).backward()
    scale = internals.scaler_scale(scaler)
    assert scale is not None and scale.dim() == 0 and float(scale) == 1024.0
    scaler.step(optimizer)
    found = internals.scaler_found_inf(scaler, optimizer)
    assert [float(f) for f in found] == [0.0]
    scaler.update()
    assert internals.scaler_found_inf(scaler, optimizer) == []  # update() clears the states


def test_scheduler_step_count_inside_its_constructor() -> None:
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    seen: list[int] = []
    original = torch.optim.lr_scheduler.StepLR.step

    def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(internals.scheduler_step_count(self))
        return original(self, *args, **kwargs)

    torch.optim.lr_scheduler.StepLR.step = step  # type: ignore[method-assign]
    try:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        optimizer.step()
        scheduler.step()
    finally:
        torch.optim.lr_scheduler.StepLR.step = original  # type: ignore[method-assign]
    assert seen == [0, 1]


def test_foreach_amax() -> None:
    values = [torch.tensor([1.0, -3.0]), torch.tensor([0.5]), torch.tensor([-(2.0**-30)])]
    assert [float(v) for v in internals.foreach_amax(values)] == [3.0, 0.5, 2.0**-30]


def test_fsdp_flat_param_and_dynamo() -> None:
    layer = nn.Linear(1, 1)
    assert internals.fsdp_flat_param(layer) is None
    assert not internals.is_flat_param(layer.weight)
    import torch.distributed.fsdp._flat_param as flat_param_module

    assert "_is_flat_param" in inspect.getsource(flat_param_module)
    assert "_flat_param" in dir(torch.distributed.fsdp.FullyShardedDataParallel)
    assert isinstance(internals.dynamo_loaded(), bool)


def test_extension_build_directory() -> None:
    path = Path(internals.extension_build_directory("fpaudit_seam_probe"))
    assert path.name == "fpaudit_seam_probe"


def test_the_compile_seam_lists_each_private_name_it_reads() -> None:
    """``torch_internals_compile``'s docstring names every private torch name it reads."""
    from fpaudit import torch_internals_compile as compile_internals

    tree = ast.parse(inspect.getsource(compile_internals))
    own = _defined_by_fpaudit([tree])
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            read.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            read |= {p for p in (node.module or "").split(".") if _private(p)}
        elif isinstance(node, ast.Constant) and re.fullmatch(r"_[a-z]\w*", str(node.value)):
            read.add(str(node.value))
    assert {"_inductor", "_orig_mod", "_torchdynamo_orig_backend"} <= read
    doc = compile_internals.__doc__ or ""
    assert sorted(n for n in read if n not in doc) == []


def test_lightnings_private_names_resolve_on_the_installed_release() -> None:
    pl = pytest.importorskip("lightning.pytorch")

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

    module = Tiny()
    assert internals.lightning_compiled(module) is None  # not compiled
    trainer = pl.Trainer(
        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    # not fitting: no batch seen, so Lightning's own rule is answered, not missing
    assert internals.lightning_should_accumulate(trainer.fit_loop) in (True, False)
    assert internals.lightning_should_accumulate(object()) is None  # a release without it

"""Fuzzing artifacts: mutate the manifest and graph JSON (types, names, paths, structure, targets, tuning knobs, tensor
devices), recompute the checksums as an attacker would, load, and run.

The only acceptable outcomes are an ArtifactError at load, or a model whose first call returns exactly the clean
artifact's logits; and no file anywhere in the example's directory (the artifact itself and the attacker's
"outside") is created, changed or deleted. Mutations are chosen so that they cannot produce a different but
well-typed graph (that would be a valid artifact computing something else, which no loader can tell from the real
one): a value is only replaced by one of another JSON type that no schema position accepts in its place, names and
paths by hostile strings or fresh identifiers, targets by names off the allow-list, a lowering's tuning knobs by
values off their autotune axis (or knobs it does not have), a copy's device by one of another type (meta above all:
its tensors have no data). A mutation that must be refused (a hostile target, name, path, knob or device) is asserted
to be.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ttftc
from tests.security.attack import Outside, copy_artifact, read_json, resign, write_json
from tests.security.conftest import PROMPT
from ttftc.aot import ArtifactError
from ttftc.cache.graph_calls import GraphFormatError, resolve_target

GRAPHS = ("graphs/b16_n1_last_kv.json", "graphs/b32_n1_last_kv.json")
FILES = ("manifest.json",) + GRAPHS
HOSTILE_STRINGS = (
    "../outside/victim.json", "/etc/passwd", "graphs/../manifest.json", "{outside}/victim.safetensors",
    "__import__('os').system('touch {marker}')", 'x")+__import__("os").system("touch {marker}")+("', "torch", "self",
    "None", "__class__", "x y", "", "a" * 300 + "!", "\x00", "é",
)
HOSTILE_TARGETS = (
    {"fn": "torch:os.system"}, {"fn": "os:system"}, {"fn": "torch.hub:load"}, {"fn": "ttftc.codegen.cpu.norm:os.system"},
    {"op": "aten::from_file.default"}, {"op": "load_library::__self__.load_library"}, {"op": "prims::neg.default"},
    {"fn": 7}, {"op": None},
)
# Off every autotune axis of every CPU lowering, as a value of any knob (0 and None are points of some axes).
HOSTILE_KNOB_VALUES = (2**61, 2**40, 10**6, -1, 0.5, "fastest", [1])
HOSTILE_DEVICES = ("meta", "cuda", "cuda:1", "xpu", "mps")
COPY = {"op": "aten::_to_copy.default"}
GARBAGE_DICT = {"evil": "touch"}
GARBAGE_LIST = [{"evil": 1}]
# For each JSON type, replacements that no schema position of that type accepts instead (see the module docstring).
RETYPES = {
    "number": ("{hostile}", GARBAGE_DICT, GARBAGE_LIST),
    "bool": ("{hostile}", GARBAGE_DICT, GARBAGE_LIST),
    "null": ("{hostile}", GARBAGE_DICT, GARBAGE_LIST),
    "str": (7, -1, 1e308, GARBAGE_DICT, GARBAGE_LIST),
    "list": ("{hostile}", 7, GARBAGE_DICT),
    "dict": ("{hostile}", GARBAGE_LIST),  # not a number: add and mul take one where a tensor node was
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "str", list: "list", dict: "dict"}[type(value)]


def _tuning_axes(target: Any) -> dict:
    """The autotune knobs of the lowering a call node targets ({} for anything else, or a target already mutated)."""
    try:
        callee = resolve_target(target)
    except GraphFormatError:
        return {}
    return dict(callee.tuning_axes or {}) if callee.takes_tuning else {}


def _node_positions(node: Any, path: tuple) -> list[tuple[tuple, str]]:
    """A call node's keyword arguments as a "knob" position (a lowering with knobs) or a "device" one (a copy)."""
    kwargs = node.get("kwargs") if isinstance(node, dict) and node.get("op") == "call_function" else None
    if not (isinstance(kwargs, dict) and isinstance(kwargs.get("dict"), dict)):
        return []
    found = [(path + ("kwargs", "dict"), "knob")] if _tuning_axes(node.get("target")) else []
    return found + ([(path + ("kwargs", "dict"), "device")] if node.get("target") == COPY else [])


def _positions(doc: Any, graph: bool) -> list[tuple[tuple, str]]:
    """(path, role) of every value and key worth mutating. Roles: value (any value), name (a name the format
    pastes into code or looks up), path (a file or constant key), target (a call target), drop (a key or element
    whose removal changes structure, never meaning: not inside a node's arguments), knob (a lowering's tuning
    config), device (a copy's device)."""
    found: list[tuple[tuple, str]] = []

    def walk(node: Any, path: tuple, in_arguments: bool) -> None:
        found.append((path, "value"))
        if isinstance(node, dict):
            for key, value in node.items():
                child = path + (key,)
                if graph and key in ("name", "target") and len(path) == 2 and path[0] == "nodes":
                    found.append((child, "target" if isinstance(value, dict) else "name"))
                    if isinstance(value, dict):
                        continue
                elif graph and key == "node" and in_arguments:
                    found.append((child, "name"))
                elif graph and key == "key" and path[:1] == ("constants",):
                    found.append((child, "path"))
                elif graph and path in (("constants",),):
                    found.append((child, "rename"))
                elif graph and in_arguments and path[-1:] == ("dict",) and path[-2:-1] == ("kwargs",):
                    found.append((child, "rename"))
                elif not graph and path == ("files",):
                    found.append((child, "rename-path"))
                if not in_arguments:
                    found.append((child, "drop"))
                walk(value, child, in_arguments or key in ("args", "kwargs"))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if not in_arguments and path[-1:] in (("nodes",), ("signatures",), ("buckets",)):
                    found.append((path + (i,), "drop"))
                if graph and path == ("nodes",):
                    found.extend(_node_positions(value, path + (i,)))
                walk(value, path + (i,), in_arguments)

    walk(doc, (), False)
    return found[1:]  # not the whole document


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _mutate(doc: Any, path: tuple, role: str, draw, outside: Outside) -> bool:
    """Apply one mutation of `role` at `path`; returns whether the result must be refused."""
    hostile = draw(st.sampled_from(HOSTILE_STRINGS)).format(outside=outside.root, marker=outside.marker)
    if role == "knob":
        knob = draw(st.sampled_from(sorted(_tuning_axes(_get(doc, path[:-2])["target"])) + ["no_such_knob"]))
        _get(doc, path)["tuning_config"] = {"dict": {knob: draw(st.sampled_from(HOSTILE_KNOB_VALUES))}}
        return True
    if role == "device":
        _get(doc, path)["device"] = {"device": draw(st.sampled_from(HOSTILE_DEVICES))}
        return True
    parent, last = _get(doc, path[:-1]), path[-1]
    if role == "value":
        replacement = draw(st.sampled_from(RETYPES[_json_type(parent[last])]))
        parent[last] = hostile if replacement == "{hostile}" else replacement
        return False
    if role == "target":
        parent[last] = draw(st.sampled_from(HOSTILE_TARGETS))
        return True
    if role in ("name", "path"):
        parent[last] = draw(st.sampled_from([hostile, "fresh_name_17"])) if role == "name" else hostile
        return parent[last] != "fresh_name_17"
    if role == "drop":
        del parent[last]
        return False
    # "rename" / "rename-path": a dict key (a constant, a keyword, a listed file) gets another name.
    new = hostile if role == "rename-path" else draw(st.sampled_from([hostile, "fresh_name_17"]))
    if new in parent:
        return False
    parent[new] = parent.pop(last)
    return role == "rename-path" or new != "fresh_name_17"


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _attack_once(data, clean_artifact: Path, clean_logits: torch.Tensor, roles: Optional[set] = None) -> None:
    """Mutate 1-3 positions (of `roles` only, where given), load, run, and check the outcome."""
    with tempfile.TemporaryDirectory(prefix="ttftc-fuzz-") as scratch:
        root = Path(scratch)
        artifact = copy_artifact(clean_artifact, root / "artifact")
        outside = Outside(root / "outside")
        must_refuse = False
        mutated: list[tuple[str, tuple]] = []
        for _ in range(data.draw(st.integers(1, 3))):
            name = data.draw(st.sampled_from(FILES if roles is None else GRAPHS))
            doc = read_json(artifact / name)
            # Never mutate inside, above or at an earlier mutation: two retypes in a row could restore the type.
            positions = [(p, r) for p, r in _positions(doc, graph=name != "manifest.json")
                         if (roles is None or r in roles)
                         and not any(f == name and (p[:len(m)] == m or m[:len(p)] == p) for f, m in mutated)]
            if not positions:
                break
            path, role = data.draw(st.sampled_from(positions))
            mutated.append((name, path))
            event(f"mutated: {name.split('/')[0]} {role}")
            must_refuse |= _mutate(doc, path, role, data.draw, outside)
            write_json(artifact / name, doc)
        resign(artifact)
        before = _snapshot(root)
        try:
            logits = ttftc.load(artifact)(PROMPT, logits_to_keep=1).logits
        except ArtifactError:
            event("outcome: ArtifactError")
        else:
            event("outcome: loaded, same logits")
            assert not must_refuse, "a hostile target, name, path, knob or device was accepted"
            assert torch.equal(logits, clean_logits), "a mutated artifact loaded and computed something else"
        assert _snapshot(root) == before, "loading created, changed or deleted a file"
        outside.assert_untouched()


_SETTINGS = dict(deadline=None, database=None, derandomize=False,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=200, **_SETTINGS)
@given(data=st.data())
def test_mutated_artifacts_are_refused_or_correct(clean_artifact, clean_logits, data):
    _attack_once(data, clean_artifact, clean_logits)


@pytest.mark.slow
@settings(max_examples=2000, **_SETTINGS)
@given(data=st.data())
def test_mutated_artifacts_are_refused_or_correct_many(clean_artifact, clean_logits, data):
    _attack_once(data, clean_artifact, clean_logits)


@settings(max_examples=40, **_SETTINGS)
@given(data=st.data())
def test_mutated_knobs_and_devices_are_refused(clean_artifact, clean_logits, data):
    """The knob and device positions alone: few among the hundreds of positions above, each must be refused."""
    _attack_once(data, clean_artifact, clean_logits, roles={"knob", "device"})

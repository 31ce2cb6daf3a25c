"""Recipes and overrides -> a validated config, and the resolved config back to YAML.

:func:`load_config` reads a YAML recipe (following ``inherit:``), applies dotted
``key=value`` overrides and validates the result against a schema of
:mod:`pretrain.config`; a validation error becomes one :class:`~pretrain.config.ConfigError`
line that names the key and, for a misspelled one, the closest valid key. Kept apart from the
schema so the sections read as the list of settings they are.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Type, TypeVar

import yaml
from pydantic import ValidationError

from pretrain.atomic_write import write_atomic
from pretrain.config import ConfigError, Section

C = TypeVar("C", bound=Section)
INHERIT_KEY = "inherit"  # a recipe may start from another: ``inherit: vit_l16_i21k.yaml``


def load_config(schema: Type[C], path: Optional[os.PathLike | str] = None,
                overrides: Sequence[str] = ()) -> C:
    """Build ``schema`` from a YAML recipe (optional) and dotted ``key=value`` overrides."""
    raw: dict = _read_yaml(Path(path)) if path is not None else {}
    parsed = parse_overrides(overrides)
    given = {key for key, _ in parsed}
    last = dict(parsed)  # a key given again wins (a wrapper appends its overrides)
    for group in getattr(schema, "exclusive_keys", ()):
        both = [f"{key}={last[key]}" for key in group if last.get(key) is not None]
        if len(both) > 1:  # (the validator's own line is about a recipe's file)
            raise ConfigError(f"{' and '.join(both)} are both given on the command line; give "
                              f"one of {' and '.join(group)}")
    for key, value in parsed:
        for group in getattr(schema, "exclusive_keys", ()):
            if key in group:
                for other in set(group) - given:
                    _set_dotted(raw, other, None)
        _set_dotted(raw, key, value)
    for key, bound_to in getattr(schema, "recipe_bound_keys", {}).items():
        if bound_to in given and key not in given:
            _drop_dotted(raw, key)
    _keep_section_defaults(schema, raw, getattr(schema, "exclusive_keys", ()))
    try:
        cfg = schema.model_validate(raw)
    except ValidationError as e:
        msg = _describe(e, schema)
        loc = [str(p) for p in e.errors()[0]["loc"] if not isinstance(p, int)]
        key = ".".join(loc)
        # not where the command line set it, or set anything inside it (a section's own check,
        # data.crop_scale's say, reports the section: the value may be the override's)
        if path is not None and key and not any(
                key == g or key.startswith(g + ".") or g.startswith(key + ".") for g in given):
            where = _file_setting(Path(path), key)
            msg = f"config file '{where}': {msg}" if where else msg
        raise ConfigError(msg) from None
    for key, why in getattr(schema, "recipe_keys", {}).items() if path is not None else ():
        if key not in raw:  # (an override is in raw by now)
            raise ConfigError(f"config file '{path}' sets no {key}: {why}")
    return cfg


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """``["optimizer.lr=3e-4", "data.crop_scale=[0.08,1]"]`` -> [(key, value), ...]; values are YAML."""
    out = []
    for arg in args:
        key, sep, text = arg.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{arg}' is not of the form key=value "
                              f"(e.g. optimizer.lr=3e-4)")
        if not text.strip():  # an unset shell variable ("init=$INIT"): never taken for null
            raise ConfigError(f"override '{arg}' has no value (an unset shell variable?); give "
                              f"one, or {key}=null to unset it")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text  # let the schema decide whether a plain string is acceptable
        out.append((key, value))
    return out


def to_yaml(cfg: Section) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def save_config(cfg: Section, path: os.PathLike | str) -> Path:
    """Write the resolved config (atomically: a crash never leaves half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, to_yaml(cfg))


def _read_yaml(path: Path, _seen: tuple = ()) -> dict:
    if path.is_dir():
        recipes = sorted(p.name for p in path.glob("*.yaml"))
        raise ConfigError(f"config file '{path}' is a directory; give one recipe file"
                          + (f", e.g. {path / recipes[0]}" if recipes else ""))
    if not path.is_file():
        if _seen:  # named by the inherit: line of the file that inherits it
            raise ConfigError(f"config file '{path}' not found: the {INHERIT_KEY}: line of "
                              f"'{_seen[-1]}' names it, relative to that file's folder; copy "
                              f"it there, or give {INHERIT_KEY}: a path that leads to it")
        raise ConfigError(f"config file '{path}' not found; recipes live in configs/")
    if path.resolve() in _seen:
        raise ConfigError(f"config file '{path}' inherits from itself")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file '{path}'{where} is not valid YAML: "
                          f"{getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys, "
                          f"not a {type(data).__name__}")
    parent = data.pop(INHERIT_KEY, None)
    if parent is None:
        return data
    base = _read_yaml(path.parent / parent, _seen + (path.resolve(),))
    return _deep_merge(base, data)


def _file_setting(path: Path, key: str, depth: int = 0) -> Optional[Path]:
    """Which file of a recipe's ``inherit:`` chain sets ``key`` (the most derived one): where a
    bad key or value is to be fixed."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
    else:
        return path
    if key in data:  # written dotted in the file
        return path
    parent = data.get(INHERIT_KEY)
    return _file_setting(path.parent / parent, key, depth + 1) \
        if isinstance(parent, str) and depth < 20 else None


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _keep_section_defaults(schema: Type[Section], raw: dict, exclusive: Sequence[Sequence[str]],
                           prefix: str = "") -> None:
    """Fill in the values a section's default sets of its own (fine-tuning's ``train``: batch
    512, 20,000 steps; pretraining's: 90 epochs) for the keys a recipe or override leaves out.
    pydantic builds a section that is given at all from its field defaults alone, so one
    ``train.precision=fp32`` would otherwise bring back a 4096 batch. A value is not filled in
    when another key of its exclusive group (``train.total_steps`` or ``train.epochs``) is given."""
    for name, field in schema.model_fields.items():
        default, section = field.default, raw.get(name)
        if not isinstance(default, Section) or not isinstance(section, dict):
            continue
        given = {f"{prefix}{name}.{key}" for key in section}
        values = default.model_dump()
        for key in default.model_fields_set - set(section):
            dotted = f"{prefix}{name}.{key}"
            if not any(dotted in group and given & set(group) for group in exclusive):
                section[key] = values[key]
        _keep_section_defaults(type(default), section, exclusive, f"{prefix}{name}.")


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{key}': '{'.'.join(parts[:i + 1])}' is a value, "
                              f"not a section")
        node = child
    node[parts[-1]] = value


def _drop_dotted(raw: dict, key: str) -> None:
    *sections, leaf = key.split(".")
    node = raw
    for part in sections:
        node = node.get(part)
        if not isinstance(node, dict):
            return
    node.pop(leaf, None)


def config_keys(schema: Type[Section], prefix: str = "") -> list[str]:
    """Every dotted leaf key of ``schema``, e.g. ``optimizer.lr``."""
    keys = []
    for name, field in schema.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            keys += config_keys(ann, prefix + name + ".")
        else:
            keys.append(prefix + name)
    return keys


def suggest_key(key: str, schema: Type[Section], given: Any = None) -> Optional[str]:
    """The valid key a user most likely meant by ``key``; ``given`` is what was set under it,
    whose keys tell, for a misspelled section, which key in which section was meant."""
    if isinstance(given, dict) and given:
        hint = _suggest_in_section(key, schema, given)
        if hint:
            return hint
    valid = config_keys(schema)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in valid if k.rsplit(".", 1)[-1] == leaf]
    if len(same_leaf) == 1:  # right name, wrong section
        return same_leaf[0]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return close[0]
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    siblings = {k.rsplit(".", 1)[-1]: k for k in valid if k.startswith(section)
                and "." not in k[len(section):]}
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.5)
    return siblings[close[0]] if close else None


def _suggest_in_section(key: str, schema: Type[Section], given: dict) -> Optional[str]:
    """For an unknown section ``key`` holding ``given``: '<closest section>.<leaf>'.

    Matching the section's name alone against whole keys picks the wrong one: as a string,
    'traning' is nearer 'tracking.uri' than any 'train.' key. The keys given under it
    ('precision') say which of the sections named alike was meant.
    """
    parent, _, name = key.rpartition(".")
    holder = getattr(_field_of(schema, parent.split(".")), "annotation", None) if parent \
        else schema
    if not (isinstance(holder, type) and issubclass(holder, Section)):
        return None
    prefix = parent + "." if parent else ""
    sections = [n for n, f in holder.model_fields.items()
                if isinstance(f.annotation, type) and issubclass(f.annotation, Section)]
    valid = set(config_keys(schema))
    leaves = _dotted(given)
    close = difflib.get_close_matches(name, sections, n=len(sections), cutoff=0.6)
    for section in close:  # closest first
        for leaf in leaves:
            if f"{prefix}{section}.{leaf}" in valid:
                return f"{prefix}{section}.{leaf}"
    if close:  # the leaf misspelled too: its nearest key in the nearest section
        inside = [k[len(prefix + close[0]) + 1:] for k in valid
                  if k.startswith(f"{prefix}{close[0]}.")]
        for leaf in leaves:
            near = difflib.get_close_matches(leaf, inside, n=1, cutoff=0.6)
            if near:
                return f"{prefix}{close[0]}.{near[0]}"
        return prefix + close[0]
    # no section named alike: a leaf that lives in exactly one section names it
    for leaf in leaves:
        owners = [k for k in valid if k.endswith("." + leaf) or k == leaf]
        if len(owners) == 1:
            return owners[0]
    return None


def _dotted(tree: dict, prefix: str = "") -> list[str]:
    """The dotted leaf keys of a nested mapping, e.g. {'a': {'b': 1}} -> ['a.b']."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out += _dotted(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def _other_stage(extra: list[str], schema: Type[Section]) -> Optional[str]:
    """The launcher of the other stage whose config has every one of the ``extra`` keys: the
    config (or output_dir) given is that stage's."""
    import finetune.config  # noqa: F401  (the fine-tune's schema, to be among the stages)
    from pretrain.config import RunConfig
    for other in RunConfig.__subclasses__():
        if other is schema or not other.launcher or not getattr(schema, "launcher", ""):
            continue
        keys = config_keys(other)
        if all(any(k == e or k.startswith(e + ".") for k in keys) for e in extra):
            return other.launcher
    return None


def _field_of(schema: Type[Section], loc: Sequence) -> Any:
    """The field (pydantic's FieldInfo) of the key at ``loc`` (``("data", "crop_scale")``);
    None where there is none."""
    holder: Any = schema
    field = None
    for part in loc:
        if not (isinstance(holder, type) and issubclass(holder, Section)):
            return None
        field = holder.model_fields.get(part)
        if field is None:
            return None
        holder = field.annotation
    return field


def _takes(field: Any, key: str) -> Optional[str]:
    """What a list-valued key takes, with its default as the example: ``"2 values, e.g.
    data.crop_scale=[0.05,1.0]"``; None for other keys."""
    import typing
    if field is None or not isinstance(field.default, tuple) or not field.default:
        return None
    example = f"{key}=[{','.join(str(v) for v in field.default)}] (the default)"
    fixed = Ellipsis not in typing.get_args(field.annotation)
    return f"{len(field.default)} values, e.g. {example}" if fixed else \
        f"a list, e.g. {example}"


def _whole_number(got) -> Optional[int]:
    """A whole number written as a float ('1e3', 2.5e4): the int it means."""
    try:
        value = float(got)
    except (TypeError, ValueError):
        return None
    return int(value) if value.is_integer() and abs(value) < 1e18 else None


def _describe(err: ValidationError, schema: Type[Section]) -> str:
    errors = err.errors()
    first = errors[0]
    key = ".".join(str(p) for p in first["loc"])
    extra = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if first["type"] == "extra_forbidden" and "." in str(first["loc"][-1]) and \
            key in config_keys(schema):  # a YAML file with 'optimizer.lr: 1e-3' in it
        section, _, leaf = key.rpartition(".")
        return (f"config key '{key}' is written dotted in a YAML file; nest it there "
                f"({section}: {{{leaf}: ...}}); dotted keys are for command-line overrides")
    other = _other_stage(extra, schema) if extra else None
    if other:
        shown = ", ".join(f"'{k}'" for k in extra[:3]) + (", ..." if len(extra) > 3 else "")
        # the fine-tune does run under DeepSpeed, set by Accelerate's config, not by these keys
        deepspeed = (f"; DeepSpeed in a fine-tune is Accelerate's config (accelerate launch "
                     f"--config_file configs/accelerate/deepspeed_zero2.yaml {schema.launcher})"
                     if any(k.split(".")[0] == "deepspeed" for k in extra) else "")
        return (f"{shown} {'is a key' if len(extra) == 1 else 'are keys'} of {other}, not "
                f"{schema.launcher}: a config (or output_dir) of the other stage? Run it with "
                f"{other}, or give {schema.launcher} one of its own{deepspeed}")
    loc = first["loc"][:-1] if first["loc"] and isinstance(first["loc"][-1], int) else first["loc"]
    listed = ".".join(str(p) for p in loc)
    takes = _takes(_field_of(schema, loc), listed) if first["type"] in (
        "missing", "too_long", "too_short", "tuple_type") else None
    if takes:  # a pair given one value or three, a list given one value
        msg = f"config key '{listed}' takes {takes}"
    elif first["type"] == "extra_forbidden":
        hint = suggest_key(key, schema, first.get("input"))
        msg = f"unknown config key '{key}'" + (f"; did you mean '{hint}'?" if hint else "")
    elif first["type"] == "value_error":
        # Our own cross-field checks already name their keys.
        msg = first["msg"].removeprefix("Value error, ")
    else:
        got = first.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        msg = f"config key '{key}': {first['msg'][0].lower()}{first['msg'][1:]}{shown}"
        whole = _whole_number(got) if first["type"].startswith("int_") else None
        if whole is not None:  # YAML reads 1e3 as a string, and 1.0e3 as a float
            msg += f"; write it as {whole}"
    if len(errors) > 1:
        msg += f" (+{len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return msg

"""Method variants: --methods x --hyper_params, with swept knobs expanded, vanilla first."""

import hashlib
import itertools
import json
from dataclasses import dataclass


@dataclass
class Variant:
    label: str
    method: str
    knobs: dict
    sweep: dict          # the swept knobs' values of this variant ({} when nothing is swept)
    reference: str = ""  # label of the vanilla variant it is compared with

    @property
    def variant_id(self) -> str:
        blob = json.dumps([self.method, self.knobs], sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]


def registered_methods() -> list[str] | None:
    try:
        from sparsevllm import available_methods
    except ImportError:  # the engine is not importable: accept any name, LLM() will judge
        return None
    return list(available_methods())


def list_valued_knobs() -> set[str]:
    """Method knobs whose value is itself a list (omnikv_filter_layers, deltakv_full_layers)."""
    try:
        from dataclasses import fields

        from sparsevllm.method_registry import methods
    except ImportError:
        return set()
    return {f.name for cls in methods().values() for f in fields(cls.config_cls)
            if "list" in str(f.type)}


def _is_sweep(knob: str, value, list_knobs) -> bool:
    """A list value is a sweep, except for a list-valued knob, which sweeps only a list of lists
    (None, the knob's default, allowed among them): [2, 8, 17] is one setting of filter layers."""
    if not isinstance(value, list):
        return False
    if knob in list_knobs:
        return bool(value) and all(isinstance(x, list) or x is None for x in value)
    return True


def expand_variants(methods: list[str], hyper_params: dict,
                    registered: list[str] | None = None,
                    list_knobs: set[str] = frozenset()) -> list[Variant]:
    """Method names x --hyper_params -> variants, vanilla first.

    A top-level key naming a method holds that method's overrides; any other key applies to every
    method, except a knob prefixed by another method's name (`quest_token_budget` never reaches
    vanilla). A list value is swept: each value (each combination, for several lists) is its own
    variant, labelled `method[knob=value]`; a knob in `list_knobs` takes a list as one value and
    sweeps a list of lists.
    """
    if not isinstance(hyper_params, dict):
        raise ValueError(f"--hyper_params must be a JSON object, got {type(hyper_params).__name__}")
    methods = list(dict.fromkeys(["vanilla", *methods]))
    if registered is not None:
        unknown = [m for m in methods if m not in registered]
        if unknown:
            raise ValueError(f"--methods: unknown method(s) {unknown}; registered: {registered}")
    names = set(methods) | set(registered or ())
    for key, value in hyper_params.items():
        if key in names and not isinstance(value, dict):
            raise ValueError(f"--hyper_params: the value of method key {key!r} must be an object "
                             f"of that method's knobs, got {value!r}")
    # Knobs of a method that is not run would be dropped without a word: say so instead.
    for key in hyper_params:
        owner = next((m for m in sorted(names) if key == m or key.startswith(m + "_")), None)
        if owner is not None and owner not in methods:
            raise ValueError(f"--hyper_params: {key!r} belongs to method {owner!r}, which is not in "
                             f"--methods ({', '.join(methods)})")
    shared = {k: v for k, v in hyper_params.items() if k not in names}

    variants = []
    for method in methods:
        knobs = {k: v for k, v in shared.items()
                 if not any(k.startswith(other + "_") for other in names if other != method)}
        knobs.update(hyper_params.get(method, {}))
        swept = [k for k, v in knobs.items() if _is_sweep(k, v, list_knobs)]
        for k in swept:
            if not knobs[k]:
                raise ValueError(f"--hyper_params: swept knob {k!r} has an empty list")
        for combo in itertools.product(*(knobs[k] for k in swept)):
            sweep = dict(zip(swept, combo))
            label = method + (f"[{','.join(f'{k}={v}' for k, v in sweep.items())}]" if sweep else "")
            variants.append(Variant(label, method, {**knobs, **sweep}, sweep))
    # Each variant is compared with the vanilla run that shares its swept engine-wide knobs.
    vanillas = [v for v in variants if v.method == "vanilla"]
    for v in variants:
        match = [r for r in vanillas if all(v.sweep.get(k) == val for k, val in r.sweep.items())]
        v.reference = (match or vanillas)[0].label
    return variants

"""Every method that overrides one of rlfleet's own takes at least the parameters the base's
callers pass positionally: a control that drops one (a base grew a parameter, the override
did not) fails only when a refresh reaches it, on a real fleet. An override that means to
narrow says so with `# type: ignore[override]` on its `def` line."""
import importlib
import inspect
import pkgutil

import rlfleet

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _positional(fn) -> tuple[int, bool]:
    params = inspect.signature(fn).parameters.values()
    return (sum(p.kind in POSITIONAL for p in params),
            any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params))


def _narrowing_declared(fn) -> bool:
    lines, _ = inspect.getsourcelines(fn)
    head = "".join(lines[:4])
    return "type: ignore[override]" in head


def _overrides():
    for info in pkgutil.walk_packages(rlfleet.__path__, "rlfleet."):
        mod = importlib.import_module(info.name)
        for cls in vars(mod).values():
            if not inspect.isclass(cls) or cls.__module__ != mod.__name__:
                continue
            for name, fn in vars(cls).items():
                if not inspect.isfunction(fn) or name.startswith("__"):
                    continue
                for base in cls.__mro__[1:]:
                    if not base.__module__.startswith("rlfleet."):
                        continue
                    if name in vars(base):
                        if inspect.isfunction(vars(base)[name]):
                            yield f"{cls.__module__}.{cls.__qualname__}.{name}", fn, vars(base)[name]
                        break


def test_overrides_take_every_parameter_their_base_takes():
    found = list(_overrides())
    assert len(found) > 20  # the walk reached the controls, registries and stores
    short = []
    for where, fn, base_fn in found:
        n, star = _positional(fn)
        if not star and n < _positional(base_fn)[0] and not _narrowing_declared(fn):
            short.append(f"{where} takes {n} positional parameters, its base "
                         f"{base_fn.__qualname__} takes {_positional(base_fn)[0]}")
    assert not short, "\n".join(short)

"""A griffe extension for the API reference (``make docs``): the docstrings use Sphinx's
cross-reference roles (:class:`Communicator`, :meth:`~ParameterServer.serve`, ...),
which Markdown would print verbatim. This turns each into inline code wrapped in an
optional mkdocs-autorefs link: a link where the target is in the reference, plain code
where it is not (a private module, say), and never a warning. ``~`` shows only the
last name, as in Sphinx."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`<>]+)`")


def _candidates(obj: griffe.Object, name: str) -> list[str]:
    """Full paths that ``name`` may mean, written in ``obj``'s docstring."""
    if name.startswith("."):
        module = obj.module
        package = module if module.is_package else module.parent
        return [f"{module.path}{name}", f"{package.path}{name}"]
    first = name.split(".")[0]
    scope: griffe.Object | None = obj
    found = []
    while scope is not None:  # the object, its class, its module, its package ...
        member = scope.members.get(first)
        if member is not None:
            try:
                target = member.target_path if member.is_alias else member.path
            except Exception:  # an alias griffe cannot resolve
                target = member.path
            rest = name[len(first):]
            found += [f"{member.path}{rest}", f"{target}{rest}"]
        scope = scope.parent
    return found + [name]


def _exists(obj: griffe.Object, path: str) -> bool:
    try:
        obj.modules_collection[path]
    except Exception:  # KeyError, or an alias that does not resolve
        return False
    return True


def convert(obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match) -> str:
        tilde, name = match.groups()
        title = name.lstrip(".").split(".")[-1] if tilde else name.lstrip(".")
        candidates = [path for path in dict.fromkeys(_candidates(obj, name)) if path.startswith("collectives")]
        if not candidates:
            return f"<code>{title}</code>"
        # autorefs takes one identifier: the first candidate griffe has loaded.
        identifier = next((path for path in candidates if _exists(obj, path)), candidates[0])
        return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        seen: set[int] = set()

        def walk(obj: griffe.Object) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = convert(obj, obj.docstring.value)
            for member in obj.members.values():
                if not member.is_alias:
                    walk(member)

        walk(pkg)

"""The commands behind the ``plait`` CLI verbs, one module or package per verb (``train``, ``plan``, ``simulate``,
``profile``, ``generate``, ...; ``plan/`` also holds ``plait energy``): each reads its arguments and files, calls
what does the work and prints; ``plait.cli`` only parses arguments and calls them. No verb imports another: what
several share sits below them (``plait.measure``, ``plait.train``, ``plait.models``). Nothing else in plait
imports this package."""

__all__: list[str] = []

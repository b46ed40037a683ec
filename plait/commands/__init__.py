"""The commands behind the ``plait`` CLI verbs, one module per verb (``train``, ``plan``, ``simulate``,
``profile``, ``generate``): each reads the files, builds the models and prints for its command; ``plait.cli`` only
parses arguments and calls them. Nothing else in plait imports this package."""

__all__: list[str] = []

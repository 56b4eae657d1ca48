"""What each command is asked to do, checked before any work (free of torch): ``run``
(``Options``, ``RunRequest``), ``sweep`` (``SweepConfig``), ``check`` (``CheckConfig``
from ``[tool.attncheck]``)."""

"""The plan verb: ``plait plan`` (:mod:`plait.commands.plan.command`), ``plait plan --energy`` and ``plait energy``
(:mod:`plait.commands.plan.energy`), with the plan's own helpers: the plans considered beside the chosen one
(:mod:`~plait.commands.plan.compare`), the job tables to paste (:mod:`~plait.commands.plan.snippet`) and the FSDP2
line (:mod:`~plait.commands.plan.fsdp`)."""

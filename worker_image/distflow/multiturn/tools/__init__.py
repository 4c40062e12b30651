"""Built-in tools for ``rollout.multiTurn.tools`` (``function: distflow.multiturn.tools.<module>:<function>``)."""

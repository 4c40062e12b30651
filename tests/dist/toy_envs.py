"""An environment for the multi-turn dist tests: every model turn gets an observation, three turns at most."""


class Echo:
    """Observes how many characters the last turn had; done after the third step; reward 0.1 per character."""

    def reset(self, record):
        self.steps = 0
        return None

    def step(self, action_text: str):
        self.steps += 1
        return f"{len(action_text)} chars", 0.1 * len(action_text), self.steps == 3

"""Multi-turn rollouts with tools or an environment (``rollout.multiTurn``), token-exact.

One step's round on one rollout dp rank, every sample a trajectory::

    prompts --render (tools in the chat template)--> prompt ids
       |
       v
    turn 0: engine generates n samples per prompt (as a single-turn rollout does)
       |      sampled ids appended as they are, mask 1
       v
    decode THIS turn's ids only -> tool calls (hermes) / environment action
       |
       v
    pool: every sample's calls at once, each with a timeout -> observations (errors as text)
       |
       v
    chat template delta (tool message + next generation prompt), tokenized alone, mask 0
       |
       v
    turn t: engine generates from prompt + every id so far (never re-encoded) ... until
            EOS with no call, maxTurns, the environment's done, or the token budget
       |
       v
    PackedBatch: input_ids = prompt + all post-prompt ids, response_mask 1 on model ids only

Token ids are never decoded and re-encoded to build the next turn's input: the
token-drift bug of agent loops that re-apply the chat template to the whole
conversation (verl #6501, #6719, #6779). The delta trick is verl's agent loop
(``ToolAgentLoop``): template a fixed conversation with and without the new
messages and keep the tokens after the assistant's end-of-turn token.

    calls       parsing tool calls out of a turn's text (hermes), the system instructions
    pool        running calls concurrently with timeouts; error kinds
    loading     the spec's tools and environment as callables (also the pre-flight's check)
    render      prompt with tools, and the delta tokens of tool / environment messages
    rollout     the turn loop over an engine's generate, packing and metrics
    tools       built-in tools (``calculator``)

Deliberately simple: tools run in threads of the worker (a hung tool's thread is
abandoned, not killed: a tool must not hold locks the worker needs); one tool
format (hermes); tools and an environment are not combined.
"""

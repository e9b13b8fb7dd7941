"""Reading model text for every API: the output assembler and its events, tool calls, reasoning, chat templates."""

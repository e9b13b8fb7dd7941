"""Reading model text for every API: tool calls, reasoning, chat templates."""

#!/usr/bin/env python3
"""The Python reference agent (docs/http-api.md): the same as `python -m leasehold.demo_agent`.

    python examples/demo_agent.py --listen 127.0.0.1:3000 --sidecar-url http://127.0.0.1:8082

The whole agent is `leasehold/demo_agent.py` (about a hundred lines on top of
`leasehold.agent`); this file is what a container runs.
"""

from leasehold.demo_agent import main

if __name__ == "__main__":
    main()

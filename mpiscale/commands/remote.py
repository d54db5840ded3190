"""``mpiscale watch`` and ``mpiscale control``: a running job seen and steered from outside, over MQTT or its
telemetry file."""

from __future__ import annotations

import argparse
import sys

from ..words import counted


def _broker_settings(args: argparse.Namespace, command: str):
    """The telemetry settings of the environment (user, password, TLS), with ``--broker`` if given; None if unset."""
    import os

    from ..telemetry import TelemetrySettings

    environ = dict(os.environ) | ({"MPISCALE_BROKER": args.broker} if args.broker else {})
    try:
        settings = TelemetrySettings.from_env(environ)
    except ValueError as error:
        print(f"mpiscale {command}: {error}", file=sys.stderr)
        return None
    if settings.broker is None:
        print(f"mpiscale {command}: give --broker HOST:PORT (or set MPISCALE_BROKER)", file=sys.stderr)
        return None
    return settings


def watch(args: argparse.Namespace) -> int:
    """Show a job from its broker (JOB --broker) or its telemetry file (--file); 0 when it finished or stopped."""
    import asyncio
    import time
    from pathlib import Path

    from ..telemetry import watch_broker, watch_file

    if args.file:
        if not Path(args.file).is_file():
            print(f"mpiscale watch: {args.file} does not exist", file=sys.stderr)
            return 2
        view = watch_file(Path(args.file), follow=not args.no_follow)
        if view.holds_no_record:
            print(f"mpiscale watch: {args.file} holds no telemetry record, only {counted(view.rejected, 'line')} of "
                  "something else: name a job's FILE.telemetry.jsonl", file=sys.stderr)  # fmt: skip
            return 2
    else:
        settings = _broker_settings(args, "watch")
        if not args.job or settings is None:
            print("mpiscale watch: give JOB --broker HOST:PORT, or --file FILE.telemetry.jsonl", file=sys.stderr)
            return 2
        try:
            view = asyncio.run(watch_broker(settings, args.job, timeout_s=args.timeout))
        except TimeoutError:
            print(f"mpiscale watch: job {args.job} did not end within {args.timeout} s", file=sys.stderr)
            return 1
        except Exception as error:  # aiomqtt's errors: say which broker and why, no traceback
            print(f"mpiscale watch: broker {settings.broker_shown}: {error}", file=sys.stderr)
            return 1
    state = view.latest.get("status", {}).get("state")
    now = time.time()
    silent = view.silent_s(now)
    if state == "stopped":
        print("mpiscale watch: the job stopped on request; its state is saved, and a resumed run goes on")
    elif view.gone(now) and silent is not None:
        print(f"mpiscale watch: the job ({state}) has said nothing for {silent:.0f} s (it beats every "
              f"{view.interval_s:.1f} s): it died without a final status, or its rank 0 is blocked",
              file=sys.stderr)  # fmt: skip
    elif state != "finished":
        print(f"mpiscale watch: the job ended {state or 'without a status'}", file=sys.stderr)
    return 0 if state in ("finished", "stopped") else 1


def control(args: argparse.Namespace) -> int:
    """Send a command to a running job; 0 when the job completed it, 1 if it rejected it or did not answer."""
    import asyncio

    from ..telemetry import LEVELS, Command, JobEnded, NoToken, new_id, send_command

    if (args.command_name == "log-level") != (args.level is not None) or (args.level or "INFO").upper() not in LEVELS:
        print("mpiscale control: log-level takes a LEVEL (DEBUG, INFO, WARNING, ERROR); other commands none",
              file=sys.stderr)  # fmt: skip
        return 2
    settings = _broker_settings(args, "control")
    if settings is None:
        return 2
    command = Command(new_id(), args.command_name, args.level.upper() if args.level else None)
    where = settings.broker_shown
    try:
        done = asyncio.run(send_command(settings, args.job, command, args.timeout))
    except JobEnded as error:
        print(f"mpiscale control: {error}", file=sys.stderr)
        return 1
    except NoToken as error:
        print(f"mpiscale control: {error}", file=sys.stderr)
        return 2
    except TimeoutError:
        print(f"mpiscale control: no answer from job {args.job} within {args.timeout:g} s: is it running, "
              f"publishing to {where}, and may this user read its topics?", file=sys.stderr)  # fmt: skip
        return 1
    except Exception as error:  # aiomqtt's errors: say which broker and why, no traceback
        print(f"mpiscale control: broker {where}: {error}", file=sys.stderr)
        return 1
    return 0 if done else 1

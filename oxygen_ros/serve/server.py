"""PolicyServer: openpi's websocket policy protocol in front of one engine's frame loop.

Protocol (what openpi-client's WebsocketClientPolicy expects, unchanged):

    connect      server sends one metadata message (msgpack map)
    request      client sends a msgpack map: the observation keys of its robot + 'prompt';
                 optional (real-time chunking, docs/rtc.md): 'prev_actions' float [n, A],
                 the rows of the chunk it executes not yet started at this observation, and
                 'inference_delay' int, the rows that will play while this one is computed;
                 optional 'question' str, answered from the newest frame (runtime/questions.py)
    response     msgpack map {'actions': float32 [H, A], 'server_timing': {...},
                 'policy_timing': {...}, 'language': {...}, 'frame_index': int,
                 'start_row': int (the first row past the delay; 0 without RTC)}; with a
                 'question': 'question' {'id', 'ok', 'reason'} (ok: it is being answered);
                 once answered, a later response of that client has 'answers' [{'id',
                 'question', 'ok', 'answer', 'reason', 'frame_index', 'stamp', ...}]
    error        a text message (the client raises RuntimeError with it); the connection stays
    GET /healthz 200 'OK' while the engine thread runs, 503 after it died
    too big      a message over the bound (ServerConfig.max_message_bytes; default the robot's
                 largest valid observation + 25%) is refused from its frame header, before
                 its payload is read: the connection closes with 1009 and a reason naming the
                 bound (the client raises ConnectionClosedError with it)
    token        with ServerConfig.token, the handshake needs `Authorization: Api-Key <token>`
                 (what openpi-client's WebsocketClientPolicy(api_key=...) sends) or
                 `Bearer <token>`; others get HTTP 401. /healthz needs none.

Threads: the asyncio event loop (its own thread) does the websocket I/O and decoding; one
engine thread runs the frame loop. Requests of all clients wait in a FairQueue, served round
robin, one whole frame at a time (act, reply, language), so frames never interleave and a
client sending bursts cannot starve another.

A request's reply is sent as soon as act() returns, before that frame's language work (the
frame loop emits the action first). Language output of a frame belongs to the client whose
observation started it and rides on that client's next response under 'language' (clients that
do not know the key ignore it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hmac
import http
import itertools
import logging
import threading
import time

import websockets
import websockets.asyncio.server as ws_server
from websockets.exceptions import PayloadTooBig
from websockets.frames import CloseCode

from oxygen_ros import __version__
from oxygen_ros.engine.types import Observation
from oxygen_ros.model.robot_spec import get_robot
from oxygen_ros.runtime.frame_loop import FrameLoop
from oxygen_ros.runtime.inputs import ObservationResult, sanitize_instruction
from oxygen_ros.runtime.params import RtcSettings
from oxygen_ros.runtime.questions import Answer
from oxygen_ros.runtime.rtc import RtcPlanner
from oxygen_ros.runtime.status import LoopStats
from oxygen_ros.serve.observations import (committed_rows, CommittedRows, keys_for,
                                           max_request_bytes, ObservationKeys, RequestError,
                                           to_observation)
from oxygen_ros.serve.queue import FairQueue
from oxygen_ros.serve.wire import packb, unpackb, WireError

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000                 # openpi's serve_policy default
HEALTH_PATH = '/healthz'
MAX_OWNED_FRAMES = 4096             # frames whose language output still has a known client
QUESTION_KEY = 'question'           # optional request field: a question about this frame


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the server listens and reads requests."""

    robot: object                   # the robot: a RobotSpec, a shipped name or a YAML path
    observation_keys: ObservationKeys | None = None   # where requests carry cameras and
    #                                   state (None: openpi's for its robots, else defaults)
    host: str = '0.0.0.0'           # openpi's default: reachable from the robot computer
    port: int = DEFAULT_PORT        # 0: any free port (see PolicyServer.port)
    default_prompt: str = ''        # used when a request has no 'prompt' ('' = required)
    max_pending: int = 4            # requests one client may have waiting; more are refused
    max_instruction_chars: int = 500
    period_s: float = 0.1           # the frame loop's nominal period (deadline statistics)
    rtc: RtcSettings = RtcSettings()   # real-time chunking of requests with 'prev_actions'
    max_message_bytes: int = 0      # largest request read; 0: observations.max_request_bytes
    token: str = ''                 # shared secret clients must send ('' = none needed)


@dataclasses.dataclass
class _Request:
    client: int
    obs: Observation
    received_s: float               # perf_counter() when the message arrived
    future: concurrent.futures.Future
    started_s: float = 0.0          # perf_counter() when the engine thread took it
    committed: CommittedRows | None = None   # the client's chunk to continue (RTC)


class _ClientChunks(RtcPlanner):
    """Real-time chunking of a server: the committed rows are the request's, not a record.

    The auto delay reads the engine's act() time (the server does not know the client's
    clock); a client that knows better sends 'inference_delay'.
    """

    request: _Request | None = None   # the request of the running tick

    def continuation(self, obs):
        committed = self.request.committed if self.request is not None else None
        if committed is None:
            return None
        return self.continue_rows(committed.rows, committed.delay)

    def record(self, action, out_s: float) -> None:
        self.latency.observe(action.inference_time_s)


class _RequestInputs:
    """The frame loop's input side for a server: this request's observation, nothing stale."""

    def __init__(self):
        self.observation: Observation | None = None
        self.instruction = None

    def build(self, now_s: float) -> ObservationResult:
        obs = self.observation
        if obs is None:
            return ObservationResult(None, {}, [])
        return ObservationResult(obs, {}, [], round(obs.stamp * 1e9))


class _Replies:
    """The frame loop's OutputSink: the action answers the request, language goes to outboxes."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self.request: _Request | None = None     # the request of the running tick

    def action(self, action, stamp_ns: int) -> None:
        self.worker.answer(self.request, action)

    def tokens(self, delta, stamp_ns: int) -> None:
        self.worker.deliver(delta.origin_frame, 'deltas', {
            'request_id': delta.request_id, 'frame_index': delta.origin_frame,
            'text': delta.text, 'token_ids': list(delta.token_ids),
            'done': delta.done, 'finish_reason': str(delta.finish_reason),
            'task': delta.task})

    def narration(self, request, stamp_ns: int) -> None:
        self.worker.deliver(request.origin_frame, 'finished', {
            'request_id': request.request_id, 'frame_index': request.origin_frame,
            'text': request.text, 'finish_reason': str(request.finish_reason),
            'task': request.task})

    def subtask(self, subtask, stamp_ns: int) -> None:
        """Send nothing more: the client got the subtask as a 'finished' item of its task.

        The frame loop already made it the action prompt of the next frames.
        """


class EngineWorker:
    """The engine thread: takes requests round robin and runs one frame loop tick per request."""

    def __init__(self, system, config: ServerConfig):
        self.system = system
        self.config = config
        self.queue = FairQueue(config.max_pending)
        self.inputs = _RequestInputs()
        self.rtc = (_ClientChunks(config.rtc, get_robot(config.robot).step_period_s)
                    if config.rtc.enabled else None)
        self.replies = _Replies(self)
        self.loop = FrameLoop.one(system, self.inputs, self.replies, config.period_s,
                                  stats=LoopStats(), rtc=self.rtc)
        self._lock = threading.Lock()             # outboxes and owners: engine + I/O threads
        self._outboxes: dict[int, dict[str, list]] = {}
        self._answers: dict[int, list[dict]] = {}   # client -> answers not yet sent
        self._question_ids = itertools.count(1)
        self._owners: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._thread = threading.Thread(target=self._run, name='oxygen-serve-engine',
                                        daemon=True)
        self.served = 0

    # ---- I/O thread side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def connect(self, client: int) -> None:
        with self._lock:
            self._outboxes[client] = {'deltas': [], 'finished': []}
            self._answers[client] = []

    def ask(self, client: int, question: str) -> dict:
        """Ask `question` for `client`; return the acknowledgement ({'id', 'ok', 'reason'}).

        The answer rides on a later response of that client under 'answers'.
        """
        question_id = next(self._question_ids)
        desk = self.loop.only.questions
        if desk is None:
            return {'id': question_id, 'ok': False,
                    'reason': 'questions are off on this server (ask_tokens 0)'}

        def answered(answer: Answer) -> None:   # the engine thread
            item = {'id': question_id, 'question': question[:200], 'ok': answer.ok,
                    'answer': answer.text, 'reason': answer.reason,
                    'frame_index': answer.frame_index, 'stamp': answer.stamp_ns * 1e-9,
                    'finish_reason': answer.finish_reason, 'tokens': answer.tokens,
                    'wait_s': answer.wait_s}
            with self._lock:
                if client in self._answers:
                    self._answers[client].append(item)
        refusal = desk.ask(question, answered)
        return {'id': question_id, 'ok': refusal is None,
                'reason': refusal.reason if refusal is not None else ''}

    def submit(self, client: int, obs: Observation, received_s: float,
               committed: CommittedRows | None = None) -> concurrent.futures.Future:
        """Queue one observation; the future gets the response dict or a RequestError."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        request = _Request(client, obs, received_s, future, committed=committed)
        if not self.queue.put(client, request):
            future.set_exception(RequestError(
                f'too many requests waiting: at most {self.config.max_pending} per client; '
                'wait for the replies'))
        return future

    def disconnect(self, client: int) -> None:
        """Forget a client: its waiting requests are cancelled, its language output dropped."""
        for request in self.queue.drop(client):
            request.future.cancel()
        with self._lock:
            self._outboxes.pop(client, None)
            self._answers.pop(client, None)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.queue.close()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- engine thread side -------------------------------------------------------------------
    def _run(self) -> None:
        while (request := self.queue.get()) is not None:
            if not request.future.set_running_or_notify_cancel():
                continue                              # its client left while it waited
            request.started_s = time.perf_counter()
            self.inputs.observation = request.obs
            self.replies.request = request
            if self.rtc is not None:
                self.rtc.request = request
            try:
                (outcome,) = self.loop.tick(time.monotonic(), serve_all=True).values()
            except Exception as err:   # noqa: BLE001 - one bad frame must not end the server
                logger.exception('frame failed')
                if not request.future.done():
                    request.future.set_exception(RuntimeError(f'engine error: {err}'))
                continue
            finally:
                self.inputs.observation = None
            if request.future.done():
                continue
            if outcome.error:                         # act() failed, not for the input
                request.future.set_exception(RuntimeError(f'engine error: {outcome.error}'))
            else:                                     # act() rejected the observation
                request.future.set_exception(RequestError(
                    outcome.rejected or 'no action for this observation'))

    def answer(self, request: _Request, action) -> None:
        """Resolve `request` with its action chunk and the client's waiting language output."""
        with self._lock:
            self._owners[action.frame_index] = request.client
            while len(self._owners) > MAX_OWNED_FRAMES:
                self._owners.popitem(last=False)
            outbox = self._outboxes.get(request.client, {'deltas': [], 'finished': []})
            language = {key: list(items) for key, items in outbox.items()}
            for items in outbox.values():
                items.clear()
            waiting = self._answers.get(request.client, [])
            answers = list(waiting)
            waiting.clear()
        act_ms = action.inference_time_s * 1e3
        self.served += 1
        reply = {
            'actions': action.actions,                              # float32 [H, robot dim]
            'frame_index': action.frame_index,
            'start_row': action.start_row,                          # first row past the delay
            'policy_timing': {'infer_ms': act_ms},
            'server_timing': {'infer_ms': act_ms,
                              'queue_ms': (request.started_s - request.received_s) * 1e3},
            'language': language,
        }
        if answers:   # only then: a client that asks nothing gets openpi's keys and language
            reply['answers'] = answers
        request.future.set_result(reply)

    def deliver(self, frame_index: int, kind: str, item: dict) -> None:
        """Put language output of `frame_index` into its client's outbox (gone: dropped)."""
        with self._lock:
            client = self._owners.get(frame_index)
            outbox = self._outboxes.get(client)
            if outbox is not None:
                outbox[kind].append(item)


UNAUTHORIZED_TEXT = ('missing or wrong API key: send "Authorization: Api-Key <token>" '
                     "(openpi-client: WebsocketClientPolicy(..., api_key=token))\n")
MAX_CLOSE_REASON_BYTES = 123        # RFC 6455: a close frame's reason fits in 123 bytes


def token_matches(authorization: str, token: str) -> bool:
    """Return whether an Authorization header carries `token` (Api-Key or Bearer scheme)."""
    scheme, _, given = authorization.strip().partition(' ')
    if not token or scheme.lower() not in ('api-key', 'bearer'):
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def _connection_class(too_big_reason: str) -> type:
    """Return a ServerConnection class whose "message too big" close (1009) gives a reason.

    Why: websockets refuses an oversized frame from its header, before reading the payload,
    and closes with its own reason (the sizes only); the client should learn what the bound
    is and how to change it.
    """
    reason = too_big_reason.encode()[:MAX_CLOSE_REASON_BYTES].decode(errors='ignore')

    class BoundedConnection(ws_server.ServerConnection):
        def __init__(self, protocol, *args, **kwargs):
            fail = protocol.fail

            def fail_with_reason(code, text=''):
                fail(code, reason if code == CloseCode.MESSAGE_TOO_BIG else text)
            protocol.fail = fail_with_reason
            super().__init__(protocol, *args, **kwargs)
    return BoundedConnection


class PolicyServer:
    """openpi's websocket policy server over an engine System; start() runs it in threads.

    system: an engine System (act / advance_language), e.g. runtime.engine_setup's engine.
    description: what the metadata message reports about the engine (plain values).
    """

    def __init__(self, system, config: ServerConfig, description: dict | None = None):
        self.spec = get_robot(config.robot)   # RobotSpecError (a ValueError) names the file
        self.keys = config.observation_keys or keys_for(self.spec)
        self.config = config
        self.max_message_bytes = config.max_message_bytes or max_request_bytes(
            self.keys, self.spec.state_dim, config.max_instruction_chars)
        self.worker = EngineWorker(system, config)
        self.metadata = self._metadata(system, description or {})
        self.port: int | None = None             # the bound port once started
        self._ids = itertools.count(1)
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name='oxygen-serve-io', daemon=True)

    def _metadata(self, system, description: dict) -> dict:
        keys = self.keys
        return {
            'server': 'oxygen_ros', 'version': __version__, 'robot': self.spec.name,
            'observation_keys': {
                'cameras': {cam: '.'.join(path) for cam, path in keys.cameras.items()},
                'state': ['.'.join(path) for path in keys.state], 'prompt': 'prompt'},
            'language': 'responses carry language output of earlier frames under "language"',
            'questions': 'optional "question" (text) in a request: acknowledged under '
                         '"question", answered on a later response under "answers"',
            'rtc': {'mode': self.config.rtc.mode,
                    'request': 'optional prev_actions [n, A] (rows of the executing chunk not '
                               'started at the observation) and inference_delay (rows)',
                    'response': 'start_row: the first row to play'},
            'engine': {k: v for k, v in description.items()
                       if isinstance(v, (str, int, float, bool))},
        }

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> int:
        """Start the engine and I/O threads; return the port once it listens (idempotent)."""
        if self._thread.is_alive():
            return self.port
        self.worker.start()
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f'server did not start listening within {timeout_s:g} s')
        if self._error is not None:
            raise self._error
        return self.port

    def stop(self) -> None:
        """Close every connection and both threads (idempotent)."""
        if self._event_loop is not None and self._stopped is not None:
            try:
                self._event_loop.call_soon_threadsafe(self._stopped.set)
            except RuntimeError:
                pass                                   # the loop has closed already
        if self._thread.is_alive():
            self._thread.join(10.0)
        self.worker.stop()

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C arrives in the calling thread meanwhile)."""
        while self._thread.is_alive():
            self._thread.join(0.5)

    def __enter__(self) -> PolicyServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- I/O thread -----------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:   # noqa: BLE001 - reported to start() (port in use, ...)
            self._error = err
            self._ready.set()

    async def _main(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        too_big = (f'message over {self.max_message_bytes / 1e6:.1f} MB, the largest '
                   f'{self.spec.name} observation this server reads (--max-message-mb)')
        async with ws_server.serve(self._connection, self.config.host, self.config.port,
                                   compression=None, max_size=self.max_message_bytes,
                                   process_request=self._handshake,
                                   create_connection=_connection_class(too_big)) as server:
            self.port = server.sockets[0].getsockname()[1]
            logger.info('serving %s on %s:%d', self.spec.name, self.config.host, self.port)
            self._ready.set()
            await self._stopped.wait()

    def _handshake(self, connection, request):
        """Answer /healthz; refuse a websocket handshake without the token; else go on."""
        if request.path == HEALTH_PATH:
            if self.worker.alive:
                return connection.respond(http.HTTPStatus.OK, 'OK\n')
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, 'engine stopped\n')
        if self.config.token and not token_matches(
                request.headers.get('Authorization', ''), self.config.token):
            logger.warning('connection from %s refused: missing or wrong API key',
                           connection.remote_address)
            return connection.respond(http.HTTPStatus.UNAUTHORIZED, UNAUTHORIZED_TEXT)
        return None                                      # go on with the websocket handshake

    async def _connection(self, websocket) -> None:
        client = next(self._ids)
        self.worker.connect(client)
        logger.info('client %d connected from %s', client, websocket.remote_address)
        previous_ms = None
        try:
            await websocket.send(packb(self.metadata))
            async for message in websocket:
                start = time.perf_counter()
                reply = await self._answer(client, message, start)
                if isinstance(reply, dict):
                    if previous_ms is not None:
                        reply['server_timing']['prev_total_ms'] = previous_ms
                    reply = packb(reply)
                await websocket.send(reply)
                previous_ms = (time.perf_counter() - start) * 1e3
        except websockets.ConnectionClosed:
            refused = websocket.protocol.parser_exc
            if isinstance(refused, PayloadTooBig):
                logger.warning('client %d: %s (bound %d bytes, --max-message-mb); connection '
                               'closed', client, refused, self.max_message_bytes)
        finally:
            self.worker.disconnect(client)
            logger.info('client %d disconnected', client)

    async def _answer(self, client: int, message, start: float) -> dict | str:
        """Return the response dict for one message, or the error text to send instead."""
        try:
            if isinstance(message, str):
                raise RequestError('expected a binary msgpack message, got text')
            request = unpackb(message)
            obs = to_observation(request, self.spec, self.config.default_prompt, self.keys)
            committed = committed_rows(request, self.spec)
            instruction = sanitize_instruction(obs.instruction,
                                               self.config.max_instruction_chars)
            if not instruction.text:
                raise RequestError('prompt: nothing left after removing control characters')
            obs.instruction = instruction.text
            obs.stamp = time.time()
            question = request.get(QUESTION_KEY)
            if isinstance(question, bytes):
                question = question.decode('utf-8', errors='replace')
            if question is not None and not isinstance(question, str):
                raise RequestError(f'{QUESTION_KEY}: expected a string, got '
                                   f'{type(question).__name__}')
            # asked before the frame is queued: answered from this frame (or a newer one)
            ack = self.worker.ask(client, question) if question is not None else None
            reply = await asyncio.wrap_future(self.worker.submit(client, obs, start, committed))
            if ack is not None:
                reply['question'] = ack
            return reply
        except (WireError, RequestError) as err:
            return f'bad request: {err}'
        except Exception as err:   # noqa: BLE001 - the client gets the reason, the server lives
            return f'server error: {err}'

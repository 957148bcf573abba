# SPDX-License-Identifier: Apache-2.0
"""The dispatcher of asynchronous calls, for bex.ps.Client and
bex.rpc.Channel: a thread that waits (in C, GIL released) on the object's
eventfd, which bex's I/O thread writes after it queued a completion, and
sets the Futures. It runs while something is outstanding."""
import concurrent.futures
import threading


class Dispatch:
    """Mixed into a _bex type with a _drain() method."""

    def _dispatch_init(self, name):
        self._alock = threading.Lock()
        self._pending = 0
        self._dispatcher = None
        self._dispatch_name = name

    def _start(self, start, *args):
        """A running Future for the call start(*args, future)."""
        fut = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()  # bex cannot take a request back
        with self._alock:
            start(*args, fut)
            self._pending += 1
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, daemon=True,
                                                    name=self._dispatch_name)
                self._dispatcher.start()
        return fut

    def _dispatch(self):
        while True:
            done = self._drain()
            for fut, result, exc in done:
                if exc is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(exc)
            with self._alock:
                self._pending -= len(done)
                if self._pending == 0:
                    self._dispatcher = None
                    return

    def _dispatch_join(self):
        t = self._dispatcher
        if t is not None and t is not threading.current_thread():
            t.join()

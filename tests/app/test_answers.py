"""Request handles (app.answers): reports posted from any thread come out as signals on the handle's own thread,
never inside the call that posts them, one end per request, nothing after silence()."""

from __future__ import annotations

import threading

from app.answers import Answer, ChatRequest, WarmReport, WarmRequest


def test_reports_from_a_worker_thread_arrive_on_the_handles_thread_in_order(qtbot):
    request = ChatRequest(1)
    seen = []
    request.started.connect(lambda: seen.append(("started", threading.get_ident())))
    request.token.connect(lambda text: seen.append((text, threading.get_ident())))
    request.finished.connect(lambda answer: seen.append((answer.text, threading.get_ident())))

    def backend():
        request.post_started()
        for piece in ("Pa", "ris"):
            request.post_token(piece)
        request.post_finished(Answer(text="Paris", finish_reason="stop"))

    worker = threading.Thread(target=backend)
    worker.start()
    worker.join()
    assert seen == []  # nothing is delivered inside the posting call or before the event loop turns
    qtbot.waitUntil(lambda: len(seen) == 4)
    ui = threading.get_ident()
    assert seen == [("started", ui), ("Pa", ui), ("ris", ui), ("Paris", ui)]
    assert request.done and request.answer.text == "Paris"


def test_a_request_ends_once_and_a_silenced_one_says_nothing_more(qtbot):
    request, quiet = ChatRequest(1), WarmRequest(2)
    ends, quiet_heard = [], []
    request.finished.connect(ends.append)
    request.failed.connect(ends.append)
    quiet.progressed.connect(lambda *a: quiet_heard.append(a))
    quiet.finished.connect(quiet_heard.append)
    request.post_failed("the model is gone")
    request.post_finished(Answer.cancelled())  # too late: the request has ended
    quiet.post_progress(1, 2)
    quiet.silence()
    quiet.post_finished(WarmReport(cancelled=True))
    qtbot.wait(50)
    assert ends == ["the model is gone"] and request.error == "the model is gone" and request.answer is None
    assert quiet_heard == [] and not quiet.done

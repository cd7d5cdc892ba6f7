"""The small-requests row's peer (bench/peer.py) is a fair one: it answers the README's 10 x 5
example with tools/reference.py's numbers and with the same fields and as many numbers as the
service's default answer."""
import pytest
import requests
import torch

from bench import peer, workloads
from tools.reference import reference_accumulated, reference_blocks

BODY = {"vectors": workloads.SEED_EXAMPLE, "factor": 2}


@pytest.fixture
def peer_answer():
    response = peer.app.test_client().post("/v1/gradients", json=BODY)
    assert response.status_code == 200
    return response.get_json()


def numbers(answer: dict) -> int:
    gradients = torch.tensor([block["gradient"] for block in answer["blocks"]])
    return gradients.numel() + torch.tensor(answer["accumulated"]).numel()


def test_peer_matches_the_reference_on_the_seed_example(peer_answer):
    vectors = torch.tensor(workloads.SEED_EXAMPLE, dtype=torch.float32)
    expected = reference_blocks(vectors, 2, "sum")
    assert [(b["row"], b["col"], b["rows"], b["cols"]) for b in peer_answer["blocks"]] == [
        (0, 0, [0, 5], [0, 5]), (0, 1, [0, 5], [5, 10]), (1, 0, [5, 10], [0, 5]), (1, 1, [5, 10], [5, 10])]
    for block, (loss, gradient) in zip(peer_answer["blocks"], expected, strict=True):
        torch.testing.assert_close(torch.tensor(block["gradient"]), gradient, rtol=0, atol=0)
        torch.testing.assert_close(torch.tensor(block["loss"]), loss)
    torch.testing.assert_close(torch.tensor(peer_answer["accumulated"]), reference_accumulated(vectors, 2, "sum"))
    assert peer_answer["bounds"] == [0, 5, 10] and numbers(peer_answer) == 1050


def test_peer_answers_what_the_service_answers(peer_answer, client):
    response = client.post("/v1/gradients", json=BODY)
    assert response.status_code == 200
    service = response.get_json()
    assert set(peer_answer) == set(service)
    assert [set(block) for block in peer_answer["blocks"]] == [set(block) for block in service["blocks"]]
    assert numbers(peer_answer) == numbers(service) == 1050
    for key in ("n", "dim", "factor", "bounds", "objective", "dtype", "device"):
        assert peer_answer[key] == service[key], key
    torch.testing.assert_close(torch.tensor(peer_answer["accumulated"]), torch.tensor(service["accumulated"]))


@pytest.mark.slow
def test_peer_serves_under_its_own_gunicorn_settings():
    """The row's launcher: sync workers, as many as asked, the same answer as in process."""
    from bench.small_requests import BODY, peer_server

    with peer_server(workers=2) as server:
        response = requests.post(server.url + "/v1/gradients", data=BODY, timeout=60,
                                 headers={"Content-Type": "application/json"})
        assert len(server.worker_pids()) == 2
        log = server.log()
    assert response.status_code == 200
    assert response.headers.get("Connection", "").lower() == "close"  # the sync worker: no keep-alive
    assert "Using worker: sync" in log
    answer = response.json()
    vectors = torch.tensor(workloads.SEED_EXAMPLE, dtype=torch.float32)
    torch.testing.assert_close(torch.tensor(answer["accumulated"]), reference_accumulated(vectors, 2, "sum"))
    assert numbers(answer) == 1050

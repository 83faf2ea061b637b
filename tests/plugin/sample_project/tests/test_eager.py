"""The shop's tasks, applied eagerly: no broker, no worker, no Redis."""

import pytest
from celery_idempotent import IdempotencyMismatchError

from shop.tasks import charge, reserve_stock, send_receipt


def test_a_redelivered_charge_runs_once(idempotency):
    twice = idempotency.redeliver(charge, (42, 999))  # one message, delivered twice

    assert twice.results[0] == twice.results[1]  # the helper asserted it too
    assert twice.executions == 1
    assert twice.record.result == twice.result
    assert twice.record.fencing_token == twice.result["fencing_token"]


def test_a_redelivery_while_the_charge_runs_waits_for_it(idempotency):
    # A visibility timeout ran out under a long charge: the copy must wait, not charge again.
    twice = idempotency.redeliver(charge, (42, 999), while_running=True)

    assert twice.executions == 1
    assert not idempotency.is_locked(charge, (42, 999))


def test_a_double_click_charges_once(idempotency):
    twice = idempotency.deliver_twice(charge, kwargs={"order_id": 7, "amount_cents": 100})

    assert twice.task_ids[0] != twice.task_ids[1]
    assert idempotency.executions(charge) == 1


def test_the_clients_key_wins(idempotency):
    twice = idempotency.deliver_twice(charge, (8, 100), key="checkout-8")

    assert idempotency.stored(charge, key="checkout-8").result == twice.result
    assert idempotency.stored(charge, (8, 100)) is None  # not under the task's own key


def test_another_amount_for_the_same_order_is_refused(idempotency):
    first = idempotency.deliver(charge, (42, 999))

    with pytest.raises(IdempotencyMismatchError):
        idempotency.deliver(charge, (42, 1))

    assert idempotency.executions(charge) == 1
    assert idempotency.stored(charge, (42, 999)).result == first
    assert not idempotency.is_locked(charge, (42, 999))


def test_forgetting_a_charge_lets_it_run_again(idempotency):
    idempotency.deliver(charge, (42, 999))
    assert charge.idempotency_status((42, 999)).state == "completed"

    charge.idempotency_forget((42, 999))  # the task's own admin API, on the test backend
    idempotency.deliver(charge, (42, 999))

    assert idempotency.executions(charge) == 2


def test_a_receipt_is_sent_once_per_message(idempotency):
    twice = idempotency.redeliver(send_receipt, (42,))
    again = idempotency.deliver(send_receipt, (42,))  # a new message: a new key

    assert again != twice.result
    assert idempotency.executions(send_receipt) == 2


def test_defaults_are_part_of_the_call(idempotency):
    first = idempotency.deliver(reserve_stock, ("sku-1",))
    second = idempotency.deliver(reserve_stock, ("sku-1", 1))

    assert second == first
    assert idempotency.executions(reserve_stock) == 1


@pytest.mark.parametrize("idempotency_backend", ["memory", "redis"])
def test_on_both_backends(idempotency, idempotency_backend):
    twice = idempotency.deliver_twice(charge, (1, 50))

    assert twice.record.fingerprint is not None
    assert idempotency.backend_url.startswith(
        "memory://" if idempotency_backend == "memory" else "redis://"
    )


def test_each_test_starts_empty(idempotency):
    assert idempotency.stored(charge, (42, 999)) is None  # stored by an earlier test

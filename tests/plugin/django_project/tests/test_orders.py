"""A Django project's tests of its idempotent task, with pytest-django and the plugin."""

import pytest
from django.db import connection

from orders.models import Order, Payment
from orders.tasks import charge


def payments(order):
    return Payment.objects.filter(order=order).count()


@pytest.mark.django_db
def test_a_redelivery_while_the_charge_runs_under_db(idempotency):
    order = Order.objects.create(number="A-1")  # inside the test's transaction
    twice = idempotency.redeliver(charge, (order.pk, 10), while_running=True)
    assert twice.executions == 1
    assert payments(order) == 1


@pytest.mark.django_db(transaction=True)
def test_a_redelivery_while_the_charge_runs_under_transactional_db(idempotency):
    order = Order.objects.create(number="A-2")  # committed
    twice = idempotency.redeliver(charge, (order.pk, 10), while_running=True)
    assert twice.executions == 1
    assert payments(order) == 1


@pytest.mark.parametrize("idempotency_backend", ["postgres"])
@pytest.mark.django_db
def test_on_the_postgres_backend_under_db(idempotency):
    order = Order.objects.create(number="A-3")
    twice = idempotency.deliver_twice(charge, (order.pk, 10))
    assert twice.record.result == twice.result
    assert payments(order) == 1
    with connection.cursor() as cursor:  # the record is in Django's test database
        cursor.execute("SELECT count(*) FROM celery_idempotency WHERE state = 'completed'")
        assert cursor.fetchone()[0] == 1


@pytest.mark.parametrize("idempotency_backend", ["postgres"])
@pytest.mark.django_db(transaction=True)
def test_on_the_postgres_backend_while_running(idempotency):
    order = Order.objects.create(number="A-4")
    twice = idempotency.redeliver(charge, (order.pk, 10), while_running=True)
    assert twice.executions == 1
    assert payments(order) == 1


@pytest.mark.parametrize("idempotency_backend", ["postgres"])
@pytest.mark.django_db
def test_on_the_postgres_backend_while_running_needs_transactional_db(idempotency):
    order = Order.objects.create(number="A-5")
    with pytest.raises(ValueError, match="needs transactional_db"):
        idempotency.redeliver(charge, (order.pk, 10), while_running=True)
    assert payments(order) == 0

"""The one model of the test project: a payment row per charge."""

from __future__ import annotations

import os

from django.db import models


class Payment(models.Model):
    order_id = models.CharField(max_length=64)
    n = models.IntegerField()
    pid = models.IntegerField()

    class Meta:
        app_label = "shop"
        db_table = os.environ.get("DJ_PAYMENTS", "shop_payment")

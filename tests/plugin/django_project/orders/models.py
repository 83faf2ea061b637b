from django.db import models


class Order(models.Model):
    number = models.CharField(max_length=32, unique=True)


class Payment(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    amount = models.IntegerField()

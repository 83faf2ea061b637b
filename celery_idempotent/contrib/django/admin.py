"""The admin page of the idempotency keys: a read-only list with filters and a "forget" action.

The list shows each key's task, state, age, TTL left and holder. "Forget" deletes the selected
rows after a confirmation page, for users with the model's ``delete`` permission; a row that a
running delivery's transaction holds is kept (its transaction commits or rolls back by itself)
and the page says so. Rows are never added or edited here: the backend owns them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib import admin, messages
from django.db import router, transaction
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone

from celery_idempotent.contrib.django.models import IdempotencyKey, task_of_row
from celery_idempotent.core.states import KeyState

__all__ = ["IdempotencyKeyAdmin", "held_keys"]


def held_keys(model: type[IdempotencyKey], keys: Iterable[str]) -> set[str]:
    """Which of ``keys`` a transaction holds now (a delivery is running): the rows that
    ``SELECT ... FOR UPDATE SKIP LOCKED`` skips, in a transaction rolled back at once."""
    wanted = list(keys)
    if not wanted:
        return set()
    using = router.db_for_write(model)
    with transaction.atomic(using=using):
        free = set(
            model.objects.using(using)
            .select_for_update(skip_locked=True)
            .filter(pk__in=wanted)
            .values_list("pk", flat=True)
        )
        transaction.set_rollback(True, using=using)
    return set(wanted) - free


class StateFilter(admin.SimpleListFilter):
    """Completed (unexpired record), queued (published, not committed yet), or expired."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("completed", "completed"), ("queued", "queued"), ("expired", "expired")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = timezone.now()
        value = self.value()
        if value in ("completed", "queued"):
            return queryset.filter(state=value, expires_at__gt=now)
        if value == "expired":
            return queryset.filter(expires_at__lte=now)
        return queryset


class TaskFilter(admin.SimpleListFilter):
    """The task (key namespace) a key belongs to."""

    title = "task"
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        keys = IdempotencyKey.objects.values_list("key", flat=True)[:10_000]
        names = sorted({task_of_row(key) for key in keys} - {""})
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if not value:
            return queryset
        # <prefix>{<namespace>:<kind>:...}: the namespace right after the hash tag's brace.
        pattern = Q()
        for kind in ("args", "id", "key"):
            pattern |= Q(key__contains="{" + f"{value}:{kind}:")
        return queryset.filter(pattern)


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(admin.ModelAdmin):
    """Read-only list of keys; "forget" deletes them (``delete`` permission, confirmation)."""

    list_display = ("key", "task", "shown_state", "age", "ttl_left", "holder")
    list_filter = (StateFilter, TaskFilter)
    search_fields = ("key",)
    ordering = ("-expires_at",)
    actions = ("forget",)
    readonly_fields = (
        "key",
        "state",
        "fencing_token",
        "fingerprint",
        "content_type",
        "content_encoding",
        "created_at",
        "expires_at",
    )
    exclude = ("result",)
    list_per_page = 100

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        found = super().get_actions(request)
        found.pop("delete_selected", None)  # "forget" keeps rows a running delivery holds
        return found

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        changelist = super().get_changelist_instance(request)
        rows = list(changelist.result_list)
        held = held_keys(self.model, [row.pk for row in rows])
        for row in rows:
            row.held = row.pk in held
        changelist.result_list = rows
        return changelist

    @admin.display(description="task")
    def task(self, obj: IdempotencyKey) -> str:
        return obj.task or "-"

    @admin.display(description="state")
    def shown_state(self, obj: IdempotencyKey) -> str:
        if getattr(obj, "held", False):
            return KeyState.RUNNING.value
        if obj.state == "claimed":
            if obj.ttl_left() > 0:  # within the claim's lease: held (a killed delivery's too)
                return KeyState.RUNNING.value
            return "free (claimed by an ended delivery)"  # and its lease has run out
        if obj.ttl_left() <= 0:
            return f"expired ({obj.state})"
        return obj.state

    @admin.display(description="age")
    def age(self, obj: IdempotencyKey) -> str:
        age = obj.age()
        return "-" if age is None else f"{age:.0f}s"

    @admin.display(description="TTL left")
    def ttl_left(self, obj: IdempotencyKey) -> str:
        return f"{obj.ttl_left():.0f}s"

    @admin.display(description="holder")
    def holder(self, obj: IdempotencyKey) -> str:
        if obj.state == "queued" and obj.result is not None:
            return f"task {bytes(obj.result).decode('utf-8', 'replace')}"
        if obj.fencing_token:
            return f"fencing token {obj.fencing_token}"
        return "-"

    @admin.action(description="Forget selected keys", permissions=["delete"])
    def forget(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        """Confirm, then delete the selected rows except those a running delivery holds."""
        keys = list(queryset.values_list("pk", flat=True))
        if request.POST.get("post") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": "Forget these idempotency keys?",
                "keys": keys,
                "opts": self.model._meta,
                "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
                "media": self.media,
            }
            return TemplateResponse(
                request, "admin/celery_idempotent/forget_confirmation.html", context
            )
        using = router.db_for_write(self.model)
        with transaction.atomic(using=using):
            free = list(
                self.model.objects.using(using)
                .select_for_update(skip_locked=True)
                .filter(pk__in=keys)
                .values_list("pk", flat=True)
            )
            deleted, _ = self.model.objects.using(using).filter(pk__in=free).delete()
        kept = len(keys) - len(free)
        self.message_user(request, f"Forgot {deleted} key(s).", messages.SUCCESS)
        if kept:
            self.message_user(
                request,
                f"Kept {kept} key(s) that a running delivery holds; they end with it.",
                messages.WARNING,
            )
        return None

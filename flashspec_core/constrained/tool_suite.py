"""Fifty hand-written tools with a request each: the forced-tool-call workload of the tests and of
benchmarks/constrained.py. The schemas vary on purpose (nested objects, enums, arrays of scalars and
of objects, integers and numbers with bounds, booleans, nullable values, required and optional
properties, tools without parameters) so that "every forced call parses and validates" means
something. `forced_call_messages` renders one as chat messages the default model understands.

Every string has a `maxLength` and every array a `maxItems`, as a careful API schema would: the
grammar guarantees the syntax of whatever the model writes, not that a small model stops writing;
with bounds, each call completes within a known budget (docs/constrained.md, "Defaults and limits").
"""
from __future__ import annotations

import json
from typing import Any

S = {"type": "string", "maxLength": 40}
LONG = {"type": "string", "maxLength": 100}
I, N, B = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    """An object; all properties are required unless `required` says otherwise."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required}


def _arr(items: dict, max_items: int) -> dict:
    return {"type": "array", "items": items, "maxItems": max_items}


def _int(minimum: int | None = None, maximum: int | None = None, kind: str = "integer") -> dict:
    bounds = {k: v for k, v in (("minimum", minimum), ("maximum", maximum)) if v is not None}
    return {"type": kind, **bounds}


NO_PARAMETERS = {"type": "object", "properties": {}}


def _tool(name: str, description: str, parameters: dict, request: str) -> dict[str, Any]:
    return {"tool": {"type": "function", "function": {"name": name, "description": description,
                                                      "parameters": parameters}}, "request": request}


TOOL_SUITE: list[dict[str, Any]] = [
    _tool("get_weather", "Current weather for a city",
          _obj({"city": S, "unit": _enum("celsius", "fahrenheit")}),
          "What's the weather in Paris in celsius?"),
    _tool("get_time", "Current time in a time zone", _obj({"timezone": S}), "What time is it in Tokyo?"),
    _tool("convert_currency", "Convert an amount between currencies",
          _obj({"amount": N, "from_currency": S, "to_currency": S}), "Convert 250 US dollars to euros."),
    _tool("add_numbers", "Add two numbers", _obj({"a": N, "b": N}), "What is 17 plus 25?"),
    _tool("send_email", "Send an email",
          _obj({"to": S, "subject": S, "body": LONG, "cc": _arr(S, 3)}, ["to", "subject", "body"]),
          "Email bob@example.com with subject Lunch and say see you at noon."),
    _tool("set_timer", "Start a countdown timer", _obj({"minutes": _int(1, 180)}), "Set a timer for 10 minutes."),
    _tool("search_web", "Search the web", _obj({"query": S, "max_results": _int(1, 20)}, ["query"]),
          "Search the web for the tallest mountain in Africa."),
    _tool("create_event", "Create a calendar event",
          _obj({"title": S, "date": S, "start_time": S, "duration_minutes": I, "attendees": _arr(S, 5)},
               ["title", "date", "start_time"]),
          "Schedule a team meeting on 2025-05-02 at 14:00 for 30 minutes."),
    _tool("book_flight", "Book a flight",
          _obj({"origin": S, "destination": S, "date": S, "passengers": _int(1, 9),
                "cabin": _enum("economy", "premium", "business", "first")}, ["origin", "destination", "date"]),
          "Book a flight from Boston to Chicago on 2025-07-04 for 2 passengers in economy."),
    _tool("translate_text", "Translate text",
          _obj({"text": S, "target_language": _enum("french", "spanish", "german", "italian")}),
          "Translate 'good morning' into Spanish."),
    _tool("get_stock_price", "Latest stock price", _obj({"symbol": S}),
          "What's Apple's stock price? The ticker is AAPL."),
    _tool("play_music", "Play music", _obj({"artist": S, "song": S, "shuffle": B}, ["artist"]),
          "Play some songs by Queen."),
    _tool("set_thermostat", "Set the thermostat",
          _obj({"temperature": _int(10, 30, "number"), "mode": _enum("heat", "cool", "auto")}),
          "Set the thermostat to 21 degrees on heat."),
    _tool("turn_on_lights", "Switch lights on",
          _obj({"room": _enum("kitchen", "bedroom", "living_room", "office"), "brightness": _int(0, 100)}, ["room"]),
          "Turn on the kitchen lights at 80 percent."),
    _tool("create_reminder", "Create a reminder",
          _obj({"text": S, "time": S, "repeat": _enum("never", "daily", "weekly")}, ["text", "time"]),
          "Remind me to water the plants at 18:00 every day."),
    _tool("get_directions", "Directions between two places",
          _obj({"origin": S, "destination": S, "mode": _enum("driving", "walking", "cycling", "transit")}),
          "How do I walk from the Louvre to the Eiffel Tower?"),
    _tool("calculate_tip", "Tip for a bill", _obj({"bill": N, "percent": N}),
          "What's a 15 percent tip on a 80 dollar bill?"),
    _tool("convert_units", "Convert a measurement",
          _obj({"value": N, "from_unit": _enum("km", "mile", "kg", "pound", "celsius", "fahrenheit"),
                "to_unit": _enum("km", "mile", "kg", "pound", "celsius", "fahrenheit")}),
          "Convert 5 km to miles."),
    _tool("add_to_cart", "Add a product to the cart",
          _obj({"product_id": S, "quantity": _int(1), "gift_wrap": B}, ["product_id", "quantity"]),
          "Add 3 of product SKU-1234 to my cart."),
    _tool("search_products", "Search the shop",
          _obj({"query": S, "max_price": N, "category": _enum("books", "electronics", "clothing", "toys"),
                "in_stock": B}, ["query"]),
          "Find electronics headphones under 100 dollars."),
    _tool("get_news", "Latest headlines",
          _obj({"topic": _enum("world", "business", "sports", "science", "tech"), "count": _int(1, 10)}),
          "Give me 5 sports headlines."),
    _tool("list_files", "List files in a folder", _obj({"path": S, "recursive": B, "pattern": S}, ["path"]),
          "List the files in /home/user/docs."),
    _tool("read_file", "Read a text file", _obj({"path": S, "max_lines": I}, ["path"]), "Show me the file notes.txt."),
    _tool("write_file", "Write a text file", _obj({"path": S, "content": LONG, "overwrite": B}, ["path", "content"]),
          "Write 'hello world' to hello.txt."),
    _tool("run_sql", "Run a read-only SQL query",
          _obj({"query": LONG, "database": _enum("sales", "users", "inventory")}),
          "From the sales database, count all orders."),
    _tool("create_user", "Create a user account",
          _obj({"username": S, "email": S, "age": _int(13, 120), "roles": _arr(_enum("admin", "editor", "viewer"), 3)},
               ["username", "email"]),
          "Create an account for alice with email alice@example.com as an editor."),
    _tool("update_address", "Update a shipping address",
          _obj({"customer_id": I,
                "address": _obj({"street": S, "city": S, "zip": S, "country": S}, ["street", "city", "country"])}),
          "Change customer 42's address to 12 Main Street, Springfield, USA."),
    _tool("order_pizza", "Order a pizza",
          _obj({"size": _enum("small", "medium", "large"),
                "toppings": _arr(_enum("cheese", "pepperoni", "mushroom", "olive", "onion"), 4), "delivery": B},
               ["size", "toppings"]),
          "Order a large pizza with pepperoni and mushroom, delivered."),
    _tool("book_hotel", "Book a hotel room",
          _obj({"city": S, "check_in": S, "nights": _int(1, 30),
                "guests": _obj({"adults": I, "children": I}, ["adults"]), "breakfast": B},
               ["city", "check_in", "nights", "guests"]),
          "Book a hotel in Rome from 2025-06-10 for 3 nights for 2 adults."),
    _tool("rate_movie", "Rate a movie", _obj({"title": S, "stars": _int(1, 5), "review": LONG}, ["title", "stars"]),
          "Give Inception 5 stars."),
    _tool("get_recipe", "Find a recipe",
          _obj({"dish": S, "diet": _enum("any", "vegetarian", "vegan", "gluten_free"), "max_minutes": I}, ["dish"]),
          "Find me a vegetarian lasagna recipe."),
    _tool("log_workout", "Log a workout",
          _obj({"activity": _enum("running", "cycling", "swimming", "yoga"), "minutes": I, "distance_km": N,
                "calories": I}, ["activity", "minutes"]),
          "Log a 30 minute run of 5 km."),
    _tool("split_bill", "Split a bill between people",
          _obj({"total": N, "people": _int(2), "names": _arr(S, 8)}, ["total", "people"]),
          "Split 120 dollars between 4 people."),
    _tool("schedule_call", "Schedule a phone call",
          _obj({"contact": S, "datetime": S, "topic": S, "urgent": B}, ["contact", "datetime"]),
          "Schedule a call with Dr. Smith on 2025-03-03 at 09:30 about test results."),
    _tool("get_exchange_rates", "Exchange rates for a base currency",
          _obj({"base": _enum("USD", "EUR", "GBP", "JPY"),
                "symbols": _arr(_enum("USD", "EUR", "GBP", "JPY", "CHF"), 5)}),
          "Show EUR rates against USD and GBP."),
    _tool("create_todo_list", "Create a to-do list",
          _obj({"title": S, "items": _arr(_obj({"task": S, "done": B}, ["task"]), 5)}),
          "Make a shopping list titled Groceries with milk and eggs."),
    _tool("plan_trip", "Plan a multi-city trip",
          _obj({"travellers": _int(1), "stops": _arr(_obj({"city": S, "nights": I}), 4),
                "budget": _enum("low", "medium", "high")}, ["travellers", "stops"]),
          "Plan a trip for 2 people: 3 nights in Lisbon then 2 nights in Porto, medium budget."),
    _tool("get_user", "Look up a user by id", _obj({"user_id": _int(1)}), "Look up user 1001."),
    _tool("ping", "Check that the service is up", NO_PARAMETERS, "Is the service up?"),
    _tool("get_location", "The device's current location", NO_PARAMETERS, "Where am I right now?"),
    _tool("set_alarm", "Set an alarm",
          _obj({"hour": _int(0, 23), "minute": _int(0, 59),
                "days": _arr(_enum("mon", "tue", "wed", "thu", "fri", "sat", "sun"), 7), "label": S},
               ["hour", "minute"]),
          "Set an alarm for 6:45 on weekdays."),
    _tool("compare_products", "Compare products side by side",
          _obj({"product_ids": _arr(S, 4), "criteria": _arr(_enum("price", "rating", "battery", "weight"), 4)},
               ["product_ids"]),
          "Compare phones P100 and P200 on price and battery."),
    _tool("file_bug", "File a bug report",
          _obj({"title": S, "severity": _enum("low", "medium", "high", "critical"), "component": S,
                "steps": _arr(S, 5), "assignee": {"type": ["string", "null"], "maxLength": 40}}, ["title", "severity"]),
          "File a critical bug: the login page crashes on submit."),
    _tool("transfer_money", "Transfer money between accounts",
          _obj({"from_account": S, "to_account": S, "amount": {"type": "number", "minimum": 0.01},
                "currency": _enum("USD", "EUR"), "memo": S}, ["from_account", "to_account", "amount", "currency"]),
          "Send 50 euros from checking to savings."),
    _tool("resize_image", "Resize an image",
          _obj({"path": S, "width": _int(1), "height": _int(1), "keep_aspect": B,
                "format": _enum("png", "jpeg", "webp")}, ["path", "width", "height"]),
          "Resize photo.png to 800 by 600."),
    _tool("geocode", "Coordinates of an address", _obj({"address": S, "country_code": S}, ["address"]),
          "Get the coordinates of 10 Downing Street, London."),
    _tool("nearby_places", "Places near a point",
          _obj({"location": _obj({"lat": _int(-90, 90, "number"), "lon": _int(-180, 180, "number")}),
                "kind": _enum("restaurant", "cafe", "pharmacy", "atm"), "radius_m": I}, ["location", "kind"]),
          "Find cafes near latitude 48.85, longitude 2.35."),
    _tool("summarize_document", "Summarize a document",
          _obj({"document_id": S, "length": _enum("short", "medium", "long"), "bullet_points": B}, ["document_id"]),
          "Give me a short summary of document doc-77."),
    _tool("classify_ticket", "Route a support ticket",
          _obj({"ticket_id": I, "category": _enum("billing", "technical", "account", "other"), "priority": _int(1, 4),
                "tags": _arr(S, 3)}, ["ticket_id", "category", "priority"]),
          "Ticket 5531 is a technical problem, priority 2."),
    _tool("update_inventory", "Adjust stock levels",
          _obj({"changes": _arr(_obj({"sku": S, "delta": I}), 5),
                "reason": _enum("sale", "restock", "damage", "audit")},
               ["changes", "reason"]),
          "Restock: add 20 units of SKU-9 and 5 units of SKU-12."),
]


def forced_call_messages(tool: dict, request: str) -> list[dict[str, str]]:
    """Chat messages that present one tool and ask for a call to it (the schema forces the format)."""
    function = tool["function"]
    system = (
        "You are a function-calling assistant. You can call this tool:\n"
        + json.dumps(function)
        + '\nReply with only a JSON object {"name": <tool name>, "arguments": <arguments>}.'
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": request}]

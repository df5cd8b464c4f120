"""Hooks for examples/welcome_notes.yaml."""


def welcome_request(row: dict) -> dict:
    """One chat request per customer; long-standing customers get a longer note."""
    years = 2026 - int(row["Subscription Date"][:4])
    return {
        "messages": [
            {"role": "system", "content": "You write warm, short customer notes."},
            {"role": "user", "content": f"Write a welcome-back note for {row['First Name']} {row['Last Name']} "
                                        f"from {row['Company']} in {row['City']}, a customer for {years} years."},
        ],
        "sampling_params": {"max_tokens": 24 if years < 3 else 40},
    }


def note_row(row: dict) -> dict:
    return {"Index": row["Index"], "email": row["Email"], "note": row["generated_text"].strip(),
            "tokens": row["num_generated_tokens"]}

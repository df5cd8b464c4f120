"""Seeded sample data: a customers CSV like the ones users point llmbatch at.

Columns: ``Index, Customer Id, First Name, Last Name, Company, City, Country, Phone 1,
Phone 2, Email, Subscription Date, Website``. Values look real; company names repeat the way
they do in real customer data (a few companies have many customers, most have one or two).
The same seed gives the same file; any number of rows streams to disk in bounded memory.

Some company names reveal their industry ("Atlas Insurance", "Turner Pharma"), most do not
("Smith LLC", "Jones-Brown"); :func:`known_industry` says which, so answers about these rows
can be scored (the demo prints its accuracy on them).
"""

from __future__ import annotations

import csv
import os
import random
import string
import zlib
from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path

COLUMNS = ["Index", "Customer Id", "First Name", "Last Name", "Company", "City", "Country",
           "Phone 1", "Phone 2", "Email", "Subscription Date", "Website"]

FIRST = """James Mary Robert Patricia John Jennifer Michael Linda David Elizabeth William Barbara
Richard Susan Joseph Jessica Thomas Sarah Charles Karen Christopher Lisa Daniel Nancy Matthew
Betty Anthony Sandra Mark Margaret Donald Ashley Steven Kimberly Andrew Emily Paul Donna Joshua
Michelle Kenneth Carol Kevin Amanda Brian Melissa George Deborah Timothy Stephanie Ronald Rebecca
Jason Laura Edward Sharon Jeffrey Cynthia Ryan Kathleen Jacob Amy Gary Angela Nicholas Shirley
Eric Anna Jonathan Brenda Stephen Pamela Larry Emma Justin Nicole Scott Helen Brandon Samantha
Benjamin Katherine Samuel Christine Gregory Debra Alexander Rachel Patrick Carolyn Frank Janet
Raymond Maria Jack Olivia Dennis Heather Jerry Diane Tyler Julie Aaron Joyce Jose Victoria Adam
Kelly Nathan Christina Henry Lauren Zachary Joan Douglas Evelyn Peter Judith Kyle Megan Noah
Andrea Ethan Cheryl Jeremy Hannah Walter Jacqueline Christian Martha Keith Gloria Roger Teresa
Terry Ann Austin Sara Sean Madison Gerald Frances Carl Kathryn Harold Janice Dylan Jean Arthur
Abigail Lawrence Alice Jordan Judy Jesse Sophia Bryan Grace Billy Denise Bruce Amber Gabriel
Doris Joe Marilyn Logan Danielle Alan Beverly Juan Isabella Albert Theresa Willie Diana Elijah
Natalie Wayne Brittany Randy Charlotte Vincent Marie Mason Kayla Roy Alexis Ralph Lori""".split()

LAST = """Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez
Gonzalez Wilson Anderson Thomas Taylor Moore Jackson Martin Lee Perez Thompson White Harris
Sanchez Clark Ramirez Lewis Robinson Walker Young Allen King Wright Scott Torres Nguyen Hill
Flores Green Adams Nelson Baker Hall Rivera Campbell Mitchell Carter Roberts Gomez Phillips
Evans Turner Diaz Parker Cruz Edwards Collins Reyes Stewart Morris Morales Murphy Cook Rogers
Gutierrez Ortiz Morgan Cooper Peterson Bailey Reed Kelly Howard Ramos Kim Cox Ward Richardson
Watson Brooks Chavez Wood James Bennett Gray Mendoza Ruiz Hughes Price Alvarez Castillo Sanders
Patel Myers Long Ross Foster Jimenez Powell Jenkins Perry Russell Sullivan Bell Coleman Butler
Henderson Barnes Gonzales Fisher Vasquez Simmons Romero Jordan Patterson Alexander Hamilton
Graham Reynolds Griffin Wallace Moreno West Cole Hayes Bryant Herrera Gibson Ellis Tran Medina
Aguilar Stevens Murray Ford Castro Marshall Owens Harrison Fernandez Mcdonald Woods Washington
Kennedy Wells Vargas Henry Chen Freeman Webb Tucker Guzman Burns Crawford Olson Simpson Porter
Hunter Gordon Mendez Silva Shaw Snyder Mason Dixon Munoz Hunt Hicks Holmes Palmer Wagner Black
Robertson Boyd Rose Stone Salazar Fox Warren Mills Meyer Rice Schmidt Garza Daniels Ferguson
Nichols Stephens Soto Weaver Ryan Gardner Payne Grant Dunn Kelley Spencer Hawkins Arnold Pierce
Vaughn Rasmussen Dominguez Mcmillan Donovan Stephenson Murillo Zuniga Benson Carlson""".split()

SUFFIXES = ["Inc", "LLC", "Ltd", "Group", "PLC", "and Sons", "& Co", "Partners", "Holdings"]
WORDS = """Pacific Summit Northwind Blue Ridge Golden Gate Silverline Redwood Evergreen Apex Pioneer
Harbor Crescent Lakeside Sterling Granite Horizon Beacon Cascade Meridian Keystone Frontier
Heritage Liberty Prairie Riverbend Sunrise Timber Vista Atlas Nova Orion Quantum Vertex""".split()
TRADES = ["Legal", "Law", "Bakery", "Foods", "Logistics", "Software", "Analytics", "Consulting",
          "Construction", "Dental", "Health", "Realty", "Motors", "Energy", "Capital", "Insurance",
          "Pharma", "Media", "Apparel", "Hotels", "Farms", "Airlines", "Security", "Robotics",
          "Textiles", "Brewing", "Bank", "Telecom", "Marine", "Education", "Games", "Furniture"]

CITIES = {
    "United States": ["New York", "Chicago", "Houston", "Phoenix", "Denver", "Seattle", "Austin", "Boston",
                      "Portland", "Atlanta", "Miami", "Detroit", "Nashville", "San Diego"],
    "United Kingdom": ["London", "Manchester", "Leeds", "Bristol", "Glasgow", "Liverpool"],
    "Germany": ["Berlin", "Hamburg", "Munich", "Cologne", "Frankfurt"],
    "France": ["Paris", "Lyon", "Marseille", "Toulouse", "Nantes"],
    "Canada": ["Toronto", "Montreal", "Vancouver", "Calgary", "Ottawa"],
    "Australia": ["Sydney", "Melbourne", "Brisbane", "Perth", "Adelaide"],
    "India": ["Mumbai", "Delhi", "Bangalore", "Chennai", "Pune"],
    "Brazil": ["Sao Paulo", "Rio de Janeiro", "Curitiba", "Recife"],
    "Japan": ["Tokyo", "Osaka", "Nagoya", "Fukuoka"],
    "Mexico": ["Mexico City", "Guadalajara", "Monterrey", "Puebla"],
    "Spain": ["Madrid", "Barcelona", "Valencia", "Seville"],
    "Italy": ["Rome", "Milan", "Naples", "Turin"],
    "Netherlands": ["Amsterdam", "Rotterdam", "Utrecht"],
    "South Africa": ["Johannesburg", "Cape Town", "Durban"],
    "Nigeria": ["Lagos", "Abuja", "Ibadan"],
    "Sweden": ["Stockholm", "Gothenburg", "Malmo"],
}
COUNTRY_WEIGHTS = [30, 10, 7, 6, 6, 5, 6, 4, 4, 3, 3, 3, 2, 2, 2, 2]
TLDS = ["com", "com", "com", "net", "org", "info", "biz", "io", "co"]
MAIL_DOMAINS = ["gmail.com", "yahoo.com", "outlook.com", "hotmail.com", "proton.me"]

# The labels the demo and examples/industry.yaml ask the model to choose from. Lower case on
# purpose: with choice-constrained greedy decoding a small model's first token decides the
# answer, and capitalised labels let one-letter tokens ("A", "F") that start sentences pull
# answers to whichever label begins with them (see bench/demo_prompt.py).
INDUSTRIES = ["legal", "retail", "technology", "financial services", "healthcare", "manufacturing", "construction",
              "real estate", "hotels and hospitality", "transportation", "energy", "education", "media",
              "agriculture", "food and beverage", "consulting", "automotive", "other"]

# The industry (one of INDUSTRIES) each word of TRADES reveals when it is in a company name.
# None: the word does not settle it ("Security": guarding, cybersecurity or securities).
TRADE_INDUSTRY: dict[str, str | None] = {
    "Legal": "legal", "Law": "legal",
    "Bakery": "food and beverage", "Foods": "food and beverage", "Brewing": "food and beverage",
    "Logistics": "transportation", "Airlines": "transportation", "Marine": "transportation",
    "Software": "technology", "Analytics": "technology", "Robotics": "technology", "Telecom": "technology",
    "Consulting": "consulting",
    "Construction": "construction",
    "Dental": "healthcare", "Health": "healthcare", "Pharma": "healthcare",
    "Realty": "real estate",
    "Motors": "automotive",
    "Energy": "energy",
    "Capital": "financial services", "Insurance": "financial services", "Bank": "financial services",
    "Media": "media", "Games": "media",
    "Apparel": "retail", "Furniture": "retail",
    "Textiles": "manufacturing",
    "Hotels": "hotels and hospitality",
    "Farms": "agriculture",
    "Education": "education",
    "Security": None,
}


def known_industry(company: str) -> str | None:
    """The true industry of a company name that reveals one (one of :data:`INDUSTRIES`), else None.

    A name reveals its industry when one of its words is a trade word with an industry in
    :data:`TRADE_INDUSTRY`: ``"Atlas Insurance"`` and ``"Atlas Insurance LLC"`` are
    ``"financial services"``, ``"Griffin Consulting"`` is ``"consulting"``. Names made of
    surnames and suffixes (``"Smith LLC"``, ``"Jones-Brown"``, ``"Lee, Kim and Cox"``) and
    ``"... Security"`` reveal none: None.
    """
    for word in company.replace(",", " ").split():
        industry = TRADE_INDUSTRY.get(word)
        if industry is not None:
            return industry
    return None


def _company(rng: random.Random) -> str:
    style = rng.random()
    if style < 0.3:
        return f"{rng.choice(LAST)} {rng.choice(SUFFIXES)}"
    if style < 0.5:
        return f"{rng.choice(LAST)}-{rng.choice(LAST)}"
    if style < 0.65:
        a, b, c = rng.sample(LAST, 3)
        return f"{a}, {b} and {c}"
    if style < 0.9:
        return f"{rng.choice(WORDS)} {rng.choice(TRADES)}{rng.choice(['', ' ' + rng.choice(SUFFIXES)])}"
    return f"{rng.choice(LAST)} {rng.choice(TRADES)}"


def _slug(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


def _phone(rng: random.Random) -> str:
    style = rng.random()
    digits = lambda n: "".join(rng.choice(string.digits) for _ in range(n))  # noqa: E731
    if style < 0.35:
        return f"{digits(3)}.{digits(3)}.{digits(4)}"
    if style < 0.6:
        return f"({digits(3)}){digits(3)}-{digits(4)}"
    if style < 0.8:
        return f"+1-{digits(3)}-{digits(3)}-{digits(4)}x{digits(4)}"
    return f"001-{digits(3)}-{digits(3)}-{digits(4)}"


def company_pool(rows: int, seed: int) -> tuple[list[str], list[float]]:
    """The companies of a file of ``rows`` rows and their (Zipf-like) weights."""
    rng = random.Random(f"companies-{seed}")
    size = max(20, rows // 8)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < size:
        name = _company(rng)
        if name not in seen:
            seen.add(name)
            names.append(name)
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(size)]
    return names, weights


def customers(rows: int, seed: int = 0) -> Iterator[dict[str, str | int]]:
    """Yield ``rows`` customer records (dicts keyed by :data:`COLUMNS`)."""
    rng = random.Random(seed)
    companies, weights = company_pool(rows, seed)
    countries = list(CITIES)
    start = date(2020, 1, 1)
    cum = None
    batch = 4096
    for base in range(0, rows, batch):
        n = min(batch, rows - base)
        picks = rng.choices(companies, weights=weights, cum_weights=cum, k=n)
        where = rng.choices(countries, weights=COUNTRY_WEIGHTS, k=n)
        for i in range(n):
            first, last = rng.choice(FIRST), rng.choice(LAST)
            company = picks[i]
            country = where[i]
            domain = f"{_slug(company)[:20] or _slug(last)}.{TLDS[zlib.crc32(company.encode()) % len(TLDS)]}"
            email_user = rng.choice([f"{_slug(first)}{_slug(last)}", f"{_slug(first)[0]}{_slug(last)}",
                                     f"{_slug(last)}{_slug(first)}{rng.randint(1, 99)}"])
            email_domain = domain if rng.random() < 0.6 else rng.choice(MAIL_DOMAINS)
            yield {
                "Index": base + i + 1,
                "Customer Id": "".join(rng.choice("0123456789abcdefABCDEF") for _ in range(15)),
                "First Name": first,
                "Last Name": last,
                "Company": company,
                "City": rng.choice(CITIES[country]),
                "Country": country,
                "Phone 1": _phone(rng),
                "Phone 2": _phone(rng),
                "Email": f"{email_user}@{email_domain}",
                "Subscription Date": (start + timedelta(days=rng.randint(0, 5 * 365))).isoformat(),
                "Website": f"{rng.choice(['http', 'https'])}://{rng.choice(['www.', ''])}{domain}/",
            }


def write_customers_csv(path: str | os.PathLike, rows: int, seed: int = 0) -> Path:
    """Write ``rows`` customers to ``path`` (streaming; memory does not grow with rows)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        for record in customers(rows, seed):
            writer.writerow(record)
    os.replace(tmp, path)
    return path

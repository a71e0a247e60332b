"""Generate the bundled sample data under ``recipes/data`` (deterministic).

    python -m polynya.recipes.tasks.make_data [--out DIR]

writes, from fixed seeds and nothing else:

- ``gsm8k/{train,test}.jsonl`` — 200/50 arithmetic word problems in GSM8K format (``question``,
  ``answer`` with worked steps, ``<<a*b=c>>`` calculator notes and ``#### N``);
- ``txt2sql/database/<db>/<db>.sqlite`` for ``shop``, ``school`` and ``library`` (three tables
  each, a few dozen rows) and ``txt2sql/{train,test}.json`` — 20 questions per database with
  gold SQL, Spider/BIRD-style records (``db_id``, ``question``, ``SQL``);
- ``longqa/{train,test}.jsonl`` — 40/10 multi-passage questions about an invented world
  (people, towns, companies, rivers), 1- and 2-hop, 20 passages each (mostly distractors).

Running it again gives byte-identical files; the SQLite files are identical as long as the
same SQLite library version writes them (its version number is part of the file header).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sqlite3
from pathlib import Path

from .common import DATA_DIR

SEED = 20261129
NAMES = ["Ava", "Ben", "Carla", "Dev", "Elif", "Femi", "Gita", "Hugo", "Ines", "Jun", "Kofi",
         "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Vik",
         "Wren", "Ximena", "Yusuf", "Zoe"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "coins", "shells"]
CITIES = ["Lisbon", "Osaka", "Quito", "Nairobi", "Oslo", "Perth"]


# ----------------------------------------------------------------------------- gsm8k
def _gsm8k_problem(rng: random.Random) -> dict:
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(10, 60), rng.randint(5, 40)
        c = rng.randint(1, a + b - 1)
        q = (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to {friend}. "
             f"How many {item} does {name} have now?")
        steps = [f"After buying, {name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.",
                 f"After giving some away, {name} has {a + b} - {c} = <<{a + b}-{c}={a + b - c}>>"
                 f"{a + b - c} {item}."]
        ans = a + b - c
    elif kind == 1:
        n, p = rng.randint(2, 9), rng.randint(2, 15)
        bill = rng.choice([x for x in (20, 50, 100, 200) if x > n * p])
        q = (f"{name} buys {n} notebooks that cost ${p} each and pays with a ${bill} bill. "
             f"How much change, in dollars, does {name} get back?")
        steps = [f"The notebooks cost {n} * {p} = <<{n}*{p}={n * p}>>{n * p} dollars.",
                 f"The change is {bill} - {n * p} = <<{bill}-{n * p}={bill - n * p}>>"
                 f"{bill - n * p} dollars."]
        ans = bill - n * p
    elif kind == 2:
        boxes, per = rng.randint(3, 12), rng.randint(4, 24)
        broken = rng.randint(1, boxes * per // 3)
        q = (f"A shop receives {boxes} boxes with {per} {item} in each box. {broken} of the "
             f"{item} are damaged and thrown away. How many {item} are left?")
        steps = [f"There are {boxes} * {per} = <<{boxes}*{per}={boxes * per}>>{boxes * per} "
                 f"{item} in total.",
                 f"{boxes * per} - {broken} = <<{boxes * per}-{broken}={boxes * per - broken}>>"
                 f"{boxes * per - broken} {item} are left."]
        ans = boxes * per - broken
    elif kind == 3:
        rate, hours, days = rng.randint(8, 30), rng.randint(2, 8), rng.randint(2, 6)
        q = (f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. "
             f"{name} then spends half of the money on a bike. How many dollars are left?")
        daily, total = rate * hours, rate * hours * days
        if total % 2:
            return _gsm8k_problem(rng)
        steps = [f"Each day {name} earns {rate} * {hours} = <<{rate}*{hours}={daily}>>{daily} "
                 "dollars.",
                 f"Over {days} days that is {daily} * {days} = <<{daily}*{days}={total}>>{total} "
                 "dollars.",
                 f"Half is spent, so {total} / 2 = <<{total}/2={total // 2}>>{total // 2} "
                 "dollars are left."]
        ans = total // 2
    elif kind == 4:
        first, more = rng.randint(5, 40), rng.randint(2, 20)
        q = (f"{name} read {first} pages on Monday. On Tuesday {name} read {more} pages more than "
             f"on Monday, and on Wednesday twice as many as on Monday. How many pages did {name} "
             "read in the three days?")
        tue, wed = first + more, 2 * first
        steps = [f"On Tuesday {name} read {first} + {more} = <<{first}+{more}={tue}>>{tue} pages.",
                 f"On Wednesday {name} read 2 * {first} = <<2*{first}={wed}>>{wed} pages.",
                 f"In total {first} + {tue} + {wed} = <<{first}+{tue}+{wed}={first + tue + wed}>>"
                 f"{first + tue + wed} pages."]
        ans = first + tue + wed
    else:
        groups, each = rng.randint(2, 9), rng.randint(2, 12)
        extra = rng.randint(1, 30)
        total = groups * each + extra
        q = (f"{name} shares {total} {item} by giving {each} to each of {groups} friends "
             f"and keeping the rest. How many {item} does {name} keep?")
        steps = [f"The friends get {groups} * {each} = <<{groups}*{each}={groups * each}>>"
                 f"{groups * each} {item}.",
                 f"{name} keeps {total} - {groups * each} = <<{total}-{groups * each}={extra}>>"
                 f"{extra} {item}."]
        ans = extra
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {ans}"}


def make_gsm8k(out: Path) -> list[Path]:
    rng = random.Random(SEED)
    problems = [_gsm8k_problem(rng) for _ in range(250)]
    return [_write_jsonl(out / "gsm8k" / "train.jsonl", problems[:200]),
            _write_jsonl(out / "gsm8k" / "test.jsonl", problems[200:])]


# ----------------------------------------------------------------------------- txt2sql
SURNAMES = ["Stone", "Okafor", "Silva", "Tanaka", "Berg", "Haddad", "Kowal", "Mendez", "Novak",
            "Reyes", "Sato", "Varga"]
_SQL_DBS = {
    "shop": """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL,
  joined_year INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL,
  price REAL NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
  product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL,
  order_date TEXT NOT NULL);""",
    "school": """
CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT NOT NULL, grade INTEGER NOT NULL,
  city TEXT NOT NULL);
CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT NOT NULL, department TEXT NOT NULL,
  credits INTEGER NOT NULL);
CREATE TABLE enrollments (student_id INTEGER NOT NULL REFERENCES students(id),
  course_id INTEGER NOT NULL REFERENCES courses(id), score INTEGER NOT NULL,
  PRIMARY KEY (student_id, course_id));""",
    "library": """
CREATE TABLE authors (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT NOT NULL,
  born INTEGER NOT NULL);
CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT NOT NULL, author_id INTEGER NOT NULL
  REFERENCES authors(id), year INTEGER NOT NULL, pages INTEGER NOT NULL, genre TEXT NOT NULL);
CREATE TABLE loans (id INTEGER PRIMARY KEY, book_id INTEGER NOT NULL REFERENCES books(id),
  member TEXT NOT NULL, loan_date TEXT NOT NULL, returned INTEGER NOT NULL);""",
}


def _people(rng: random.Random, n: int) -> list[str]:
    pool = [f"{f} {s}" for f in NAMES for s in SURNAMES]
    return rng.sample(pool, n)


def _shop(rng: random.Random) -> tuple[dict, list[tuple[str, str]]]:
    customers = [(i, n, rng.choice(CITIES[:4]), rng.randint(2015, 2024))
                 for i, n in enumerate(_people(rng, 24), 1)]
    cats = ["toys", "books", "kitchen", "garden"]
    goods = ["kite", "puzzle", "robot", "atlas", "novel", "cookbook", "kettle", "whisk", "teapot",
             "skillet", "rake", "hose", "shovel", "planter", "yo-yo", "diary", "ladle", "trowel"]
    prices = rng.sample(range(199, 9999, 25), len(goods))
    products = [(i, g, cats[i % 4], p / 100)
                for i, (g, p) in enumerate(zip(goods, prices, strict=True), 1)]
    orders = [(i, rng.randint(1, 20), rng.randint(1, len(products)), rng.randint(1, 5),
               f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}") for i in range(1, 61)]
    c, p = customers, products
    qs = [(f"How many customers live in {city}?",
           f"SELECT COUNT(*) FROM customers WHERE city = '{city}'") for city in CITIES[:3]]
    qs += [(f"List the names of all products in the {k} category.",
            f"SELECT name FROM products WHERE category = '{k}'") for k in cats[:2]]
    qs += [("What is the name of the most expensive product?",
            "SELECT name FROM products ORDER BY price DESC LIMIT 1"),
           ("What are the three cheapest products, from the cheapest up?",
            "SELECT name FROM products ORDER BY price ASC LIMIT 3")]
    qs += [(f"What is the average price of products in the {k} category?",
            f"SELECT AVG(price) FROM products WHERE category = '{k}'") for k in cats[2:]]
    qs += [(f"How many orders has {c[i][1]} placed?",
            "SELECT COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id "
            f"WHERE customers.name = '{c[i][1]}'") for i in (0, 5)]
    qs += [(f"What total quantity of the product '{p[i][1]}' has been ordered?",
            "SELECT SUM(quantity) FROM orders JOIN products ON orders.product_id = products.id "
            f"WHERE products.name = '{p[i][1]}'") for i in (1, 8)]
    qs += [("List the names of customers who joined in 2020 or later, in alphabetical order.",
            "SELECT name FROM customers WHERE joined_year >= 2020 ORDER BY name"),
           ("Which customers have never placed an order? Give their names.",
            "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)"),
           ("How many different customers have ordered kitchen products?",
            "SELECT COUNT(DISTINCT orders.customer_id) FROM orders JOIN products ON "
            "orders.product_id = products.id WHERE products.category = 'kitchen'"),
           (f"How much money (price times quantity) have customers from {CITIES[1]} spent?",
            "SELECT SUM(products.price * orders.quantity) FROM orders JOIN products ON "
            "orders.product_id = products.id JOIN customers ON orders.customer_id = customers.id "
            f"WHERE customers.city = '{CITIES[1]}'"),
           ("How many products are there in each category?",
            "SELECT category, COUNT(*) FROM products GROUP BY category"),
           ("How many orders were placed in March 2024?",
            "SELECT COUNT(*) FROM orders WHERE order_date LIKE '2024-03-%'"),
           ("What is the largest quantity ordered in a single order?",
            "SELECT MAX(quantity) FROM orders")]
    return {"customers": customers, "products": products, "orders": orders}, qs


def _school(rng: random.Random) -> tuple[dict, list[tuple[str, str]]]:
    students = [(i, n, rng.randint(9, 12), rng.choice(CITIES[2:])) for i, n in
                enumerate(_people(rng, 30), 1)]
    depts = ["Maths"] * 4 + ["Science"] * 3 + ["History"] * 2 + ["Art"] * 2
    titles = ["Algebra", "Geometry", "Statistics", "Calculus", "Biology", "Chemistry", "Physics",
              "World History", "Civics", "Painting", "Sculpture"]
    courses = [(i, t, d, rng.choice([2, 3, 4]))
               for i, (t, d) in enumerate(zip(titles, depts, strict=True), 1)]
    enrollments = []
    for cid in range(1, len(courses) + 1):
        takers = sorted(rng.sample(range(1, 27), rng.randint(4, 10)))  # students 27-30: none
        scores = rng.sample(range(40, 101), len(takers))
        enrollments += [(s, cid, sc) for s, sc in zip(takers, scores, strict=True)]
    s, co = students, courses
    qs = [(f"How many students are in grade {g}?",
           f"SELECT COUNT(*) FROM students WHERE grade = {g}") for g in (9, 11)]
    qs += [(f"List the titles of the courses of the {d} department.",
            f"SELECT title FROM courses WHERE department = '{d}'") for d in ("Maths", "Science")]
    qs += [(f"What is the average score in {co[i][1]}?",
            "SELECT AVG(score) FROM enrollments JOIN courses ON enrollments.course_id = courses.id "
            f"WHERE courses.title = '{co[i][1]}'") for i in (0, 4)]
    qs += [(f"Which student got the highest score in {co[i][1]}?",
            "SELECT students.name FROM enrollments JOIN students ON enrollments.student_id = "
            "students.id JOIN courses ON enrollments.course_id = courses.id "
            f"WHERE courses.title = '{co[i][1]}' ORDER BY enrollments.score DESC LIMIT 1")
           for i in (2, 7)]
    qs += [(f"How many courses is {s[i][1]} enrolled in?",
            "SELECT COUNT(*) FROM enrollments JOIN students ON enrollments.student_id = "
            f"students.id WHERE students.name = '{s[i][1]}'") for i in (1, 3)]
    qs += [(f"List the names of students from {CITIES[3]}, sorted by name.",
            f"SELECT name FROM students WHERE city = '{CITIES[3]}' ORDER BY name"),
           (f"What is the total number of credits of the courses {s[6][1]} takes?",
            "SELECT SUM(courses.credits) FROM enrollments JOIN courses ON enrollments.course_id = "
            "courses.id JOIN students ON enrollments.student_id = students.id "
            f"WHERE students.name = '{s[6][1]}'"),
           ("Which department offers the most courses?",
            "SELECT department FROM courses GROUP BY department ORDER BY COUNT(*) DESC LIMIT 1"),
           ("How many different students scored above 90 in some course?",
            "SELECT COUNT(DISTINCT student_id) FROM enrollments WHERE score > 90"),
           ("Which students are not enrolled in any course?",
            "SELECT name FROM students WHERE id NOT IN (SELECT student_id FROM enrollments)"),
           ("How many students are there in each grade?",
            "SELECT grade, COUNT(*) FROM students GROUP BY grade"),
           ("Which course titles have more than 7 students enrolled?",
            "SELECT courses.title FROM courses JOIN enrollments ON enrollments.course_id = "
            "courses.id GROUP BY courses.id HAVING COUNT(*) > 7"),
           (f"What is the average score of students who live in {CITIES[2]}?",
            "SELECT AVG(enrollments.score) FROM enrollments JOIN students ON "
            f"enrollments.student_id = students.id WHERE students.city = '{CITIES[2]}'"),
           ("What is the lowest score recorded in any course?",
            "SELECT MIN(score) FROM enrollments"),
           ("How many courses are worth 4 credits?",
            "SELECT COUNT(*) FROM courses WHERE credits = 4")]
    return {"students": students, "courses": courses, "enrollments": enrollments}, qs


def _library(rng: random.Random) -> tuple[dict, list[tuple[str, str]]]:
    authors = [(i, n, rng.choice(["Kenya", "Norway", "Peru", "Japan"]), rng.randint(1920, 1990))
               for i, n in enumerate(_people(rng, 12), 1)]
    adjs = ["Silent", "Golden", "Hidden", "Last", "Winter", "Paper", "Distant", "Burning"]
    nouns = ["Harbour", "Garden", "Letter", "Mountain", "Clock", "River"]
    titles = rng.sample([f"The {a} {n}" for a in adjs for n in nouns], 30)
    genres = ["mystery", "poetry", "history", "fantasy"]
    pages = rng.sample(range(120, 900), len(titles))
    books = [(i, t, rng.randint(1, 10), rng.randint(1950, 2023), pg, rng.choice(genres))
             for i, (t, pg) in enumerate(zip(titles, pages, strict=True), 1)]  # 11-12: no books
    members = ["Ada", "Bruno", "Chen", "Dana", "Eli", "Fatima"]
    loans = [(i, rng.randint(1, 30), members[min(rng.randint(0, 6), 5)],
              f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", int(rng.random() < 0.7))
             for i in range(1, 41)]
    a, b = authors, books
    qs = [(f"How many books by {a[i][1]} does the library have?",
           "SELECT COUNT(*) FROM books JOIN authors ON books.author_id = authors.id "
           f"WHERE authors.name = '{a[i][1]}'") for i in (0, 2)]
    qs += [(f"List the titles of the {g} books.", f"SELECT title FROM books WHERE genre = '{g}'")
           for g in genres[:2]]
    qs += [(f"Who wrote '{b[i][1]}'?",
            "SELECT authors.name FROM books JOIN authors ON books.author_id = authors.id "
            f"WHERE books.title = '{b[i][1]}'") for i in (3, 11)]
    qs += [(f"How many times has '{b[i][1]}' been borrowed?",
            "SELECT COUNT(*) FROM loans JOIN books ON loans.book_id = books.id "
            f"WHERE books.title = '{b[i][1]}'") for i in (5, 9)]
    qs += [(f"How many books has {m} borrowed?",
            f"SELECT COUNT(*) FROM loans WHERE member = '{m}'") for m in members[1:3]]
    qs += [("Which book has the most pages?",
            "SELECT title FROM books ORDER BY pages DESC LIMIT 1"),
           ("What is the average number of pages of books published after 2000?",
            "SELECT AVG(pages) FROM books WHERE year > 2000"),
           ("How many books are on loan right now (borrowed and not returned)?",
            "SELECT COUNT(*) FROM loans WHERE returned = 0"),
           (f"List the names of the authors from {a[1][2]}, from the oldest to the youngest.",
            f"SELECT name FROM authors WHERE country = '{a[1][2]}' ORDER BY born"),
           ("Which authors have no books in the library?",
            "SELECT name FROM authors WHERE id NOT IN (SELECT author_id FROM books)"),
           (("List the titles of the books published before 1970, oldest first (books of the same "
             "year in alphabetical order)."),
            "SELECT title FROM books WHERE year < 1970 ORDER BY year, title"),
           ("How many books are there in each genre?",
            "SELECT genre, COUNT(*) FROM books GROUP BY genre"),
           ("Which member has borrowed the most books?",
            "SELECT member FROM loans GROUP BY member ORDER BY COUNT(*) DESC LIMIT 1"),
           (f"What is the title of the oldest book by {a[0][1]}?",
            "SELECT books.title FROM books JOIN authors ON books.author_id = authors.id "
            f"WHERE authors.name = '{a[0][1]}' ORDER BY books.year LIMIT 1"),
           ("What is the total number of pages of all fantasy books?",
            "SELECT SUM(pages) FROM books WHERE genre = 'fantasy'")]
    return {"authors": authors, "books": books, "loans": loans}, qs


def _check_gold(conn: sqlite3.Connection, db_id: str, sql: str) -> None:
    """Gold queries must return rows, and an ordered one must order totally: with ``LIMIT n``
    no tie across the cut, without it no tie at all (the reward compares an ordered gold
    result as a list, so the order of tied rows, which SQLite leaves open, would decide it)."""
    rows = conn.execute(sql).fetchall()
    if not rows or rows[0][0] is None:
        raise RuntimeError(f"{db_id}: empty gold result for {sql}")
    if "ORDER BY" not in sql:
        return
    head, _, n = sql.rpartition(" LIMIT ") if " LIMIT " in sql else (sql, "", "")
    key = head.split("ORDER BY")[1].replace(" DESC", "").replace(" ASC", "")
    keys = conn.execute(f"SELECT {key} FROM {head.split(' FROM ', 1)[1]}").fetchall()
    if n:
        if len(keys) > int(n) and keys[int(n) - 1] == keys[int(n)]:
            raise RuntimeError(f"{db_id}: LIMIT {n} cuts through a tie in {sql}")
    elif any(a == b for a, b in itertools.pairwise(keys)):
        raise RuntimeError(f"{db_id}: ORDER BY{key} has ties, so the order is not defined: {sql}")


def make_txt2sql(out: Path) -> list[Path]:
    rng = random.Random(SEED + 1)
    root = out / "txt2sql"
    written, records = [], []
    for db_id, build in (("shop", _shop), ("school", _school), ("library", _library)):
        tables, questions = build(rng)
        path = root / "database" / db_id / f"{db_id}.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        conn = sqlite3.connect(path)
        conn.executescript(_SQL_DBS[db_id])
        for table, rows in tables.items():
            conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
        conn.commit()
        for _, sql in questions:
            _check_gold(conn, db_id, sql)
        conn.execute("VACUUM")
        conn.close()
        written.append(path)
        records += [{"db_id": db_id, "question": q, "SQL": sql} for q, sql in questions]
    test = [r for i, r in enumerate(records) if i % 4 == 3]
    train = [r for i, r in enumerate(records) if i % 4 != 3]
    for split, rows in (("train", train), ("test", test)):
        path = root / f"{split}.json"
        path.write_bytes((json.dumps(rows, indent=1, ensure_ascii=False) + "\n").encode())
        written.append(path)
    return written


# ----------------------------------------------------------------------------- longqa
_SYL = ["ka", "lo", "ven", "dri", "mar", "tes", "ul", "or", "bel", "nim", "sa", "quo", "rin",
        "tha", "gor", "ef", "pal", "zu", "mi", "dor"]
_FILLER = {
    "town": ["Its winters are long and the summers are short.",
             "Local records describe a busy market every {day}.",
             "Visitors often mention the {colour} roofs and the narrow streets.",
             "A small museum keeps maps, letters and old photographs.",
             "The {colour} banner of the local choir hangs in the hall.",
             "A footbridge built of {material} crosses the old canal.",
             "The annual fair brings musicians from the whole region.",
             "Its library holds more than {n} volumes.",
             "A weekly newspaper has been printed there since {year}.",
             "The railway station was rebuilt after a fire in {year2}.",
             "Its football club plays in {colour} shirts and has never won a title.",
             "Farmers bring cheese, honey and {crop} to the square in autumn."],
    "person": ["{first} enjoys long walks on {day} evenings.",
               "{first} collects old maps, letters and photographs.",
               "As a child, {first} won a {colour} ribbon at a school fair.",
               "{first} keeps bees and grows {crop} in a small garden.",
               "Friends describe {first} as patient, curious and rarely on time.",
               "{first} sings in a choir that rehearses every {day}.",
               "{first} once spent {minutes} weeks repairing an old {material} boat.",
               "{first} once gave a short talk about growing {crop} at a regional meeting."],
    "company": ["The company employs about {n} people.",
                "Its logo is a {colour} circle on a plain white square.",
                "It opened a second office in {year2} and closed it a few years later.",
                "Its staff meet every {day} morning to plan the week.",
                "The company sponsors a small festival of music each summer.",
                "Its first product was sold in a shop that no longer exists.",
                "An internal newsletter has been printed since {year}.",
                "It keeps a collection of {minutes} early prototypes in its lobby."],
}


def _word(rng: random.Random, used: set, parts: int = 2) -> str:
    while True:
        w = "".join(rng.choice(_SYL) for _ in range(parts)).capitalize()
        if w not in used and len(w) > 3:
            used.add(w)
            return w


def _filler(rng: random.Random, kind: str, k: int, first: str = "") -> str:
    fill = dict(day=rng.choice(["Monday", "Thursday", "Saturday"]),  # noqa: C408
                colour=rng.choice(["red", "green", "grey", "blue"]),
                material=rng.choice(["stone", "iron", "oak"]), n=rng.randint(2, 90) * 1000,
                year=rng.randint(1850, 1990), year2=rng.randint(1900, 2000),
                crop=rng.choice(["apples", "pears", "plums"]), minutes=rng.randint(2, 9),
                first=first)
    return " ".join(s.format(**fill) for s in rng.sample(_FILLER[kind], k))


def _world(rng: random.Random) -> tuple[dict, dict, dict]:
    used: set = set()
    rivers = [f"the {_word(rng, used)} River" for _ in range(8)]
    towns = {}
    for _ in range(20):
        name = _word(rng, used) + rng.choice(["ford", "holm", "vale", "wick", "by"])
        towns[name] = {"river": rng.choice(rivers), "founded": rng.randint(900, 1700),
                       "population": rng.randint(3, 400) * 1000}
    people = {}
    for _ in range(30):
        name = f"{_word(rng, used)} {_word(rng, used, 3)}"
        people[name] = {"born_in": rng.choice(list(towns)), "born": rng.randint(1900, 1995),
                        "job": rng.choice(["engineer", "chemist", "painter", "pilot", "judge"])}
    companies = {}
    for founder in rng.sample(list(people), 12):
        name = _word(rng, used) + rng.choice([" Works", " Instruments", " Mills", " Shipping"])
        companies[name] = {"founder": founder, "founded": rng.randint(1920, 2010),
                           "town": rng.choice(list(towns))}
    for person in people.values():
        person["employer"] = rng.choice(list(companies))
    return towns, people, companies


def _passages(rng: random.Random, towns: dict, people: dict, companies: dict) -> dict:
    out = {}
    for t, f in towns.items():
        out[t] = (f"{t} is a town on the banks of {f['river']}. It was founded in {f['founded']} "
                  f"and has about {f['population']} inhabitants. " + _filler(rng, "town", 8))
    for p, f in people.items():
        first = p.split()[0]
        article = "an" if f["job"][0] in "aeiou" else "a"
        out[p] = (f"{p} (born {f['born']}) is {article} {f['job']}. {first} was born in "
                  f"{f['born_in']} and works for {f['employer']}. "
                  + _filler(rng, "person", 6, first))
    for c, f in companies.items():
        out[c] = (f"{c} is a company founded in {f['founded']} by {f['founder']}. Its head office "
                  f"is in {f['town']}. " + _filler(rng, "company", 6))
    return out


def _longqa_question(rng: random.Random, towns: dict, people: dict, companies: dict):
    kind = rng.randrange(5)
    person = rng.choice(list(people))
    company = rng.choice(list(companies))
    p, c = people[person], companies[company]
    if kind == 0:
        return f"In which town was {person} born?", p["born_in"], [person]
    if kind == 1:
        return f"In what year was {company} founded?", str(c["founded"]), [company]
    if kind == 2:
        return (f"Which river flows through the town where {person} was born?",
                towns[p["born_in"]]["river"], [person, p["born_in"]])
    if kind == 3:
        return (f"Who founded the company that {person} works for?",
                companies[p["employer"]]["founder"], [person, p["employer"]])
    return (f"In what year was the founder of {company} born?",
            str(people[c["founder"]]["born"]), [company, c["founder"]])


def make_longqa(out: Path, passages_per_question: int = 20) -> list[Path]:
    rng = random.Random(SEED + 2)
    towns, people, companies = _world(rng)
    texts = _passages(rng, towns, people, companies)
    records, asked = [], set()
    while len(records) < 50:
        question, answer, support = _longqa_question(rng, towns, people, companies)
        if question in asked:
            continue
        asked.add(question)
        i = len(records)
        others = [t for t in texts if t not in support]
        titles = support + rng.sample(others, passages_per_question - len(support))
        rng.shuffle(titles)
        answers = [answer] + ([answer[len("the "):]] if answer.startswith("the ") else [])
        records.append({"id": f"synth-{i}", "question": question, "answers": answers,
                        "hops": len(support), "supporting": support,
                        "passages": [{"title": t, "text": texts[t]} for t in titles]})
    return [_write_jsonl(out / "longqa" / "train.jsonl", records[:40]),
            _write_jsonl(out / "longqa" / "test.jsonl", records[40:])]


# ----------------------------------------------------------------------------- files
def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    return path


def generate(out: str | Path = DATA_DIR) -> list[Path]:
    """Write every bundled sample file under ``out``; returns the paths written."""
    out = Path(out)
    return make_gsm8k(out) + make_txt2sql(out) + make_longqa(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(DATA_DIR), help="output folder (default: bundled)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"{path.stat().st_size:>8}  {path}")


if __name__ == "__main__":
    main()
